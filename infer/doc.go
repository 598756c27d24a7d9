// Package infer is `qvd eval` and `qvd predict`: it finds a checkpoint's weights and the
// config they were trained with, builds that model, and evaluates it on the test split
// (accuracy, loss, confusion matrix) or classifies image files. The model's input shape comes
// from the config, the checkpoint's record or the weights themselves, so prediction needs no
// dataset on the machine.
//
// It reads no flags (Options carries their values; errors name them, and wrap
// configs.ErrInvalid where the caller gave something unusable) and writes only to the
// io.Writer it is given. It must not import cmd/qvd, job or trainer internals.
package infer
