// Package archtest keeps docs/architecture.md true: its test reads the layer table there and
// fails when a package of the module is missing from it or imports a package of a higher
// layer. It has no code of its own besides the table's parser, and nothing imports it.
package archtest
