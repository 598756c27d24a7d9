// Package arena is qvd's memory for large, long-lived buffers: parameters, gradients, master
// weights, optimizer moments, communication buckets and activation workspace. Each block is
// its own anonymous mapping (mmap), outside the Go heap, so
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
//
//   - the garbage collector neither scans nor counts it: the heap's GOGC headroom (by
//     default the heap may grow to twice its live size before a collection) applies to the
//     small objects only, not to gigabytes of model state;
//   - freeing a block gives its pages back to the kernel at once (munmap), instead of when
//     the scavenger gets to them;
//   - blocks of 2 MiB and more start on a 2 MiB boundary and are advised MADV_HUGEPAGE, so
//     where the kernel's transparent huge pages are in "madvise" or "always" mode the
//     optimizer's passes over hundreds of megabytes take one TLB entry per 2 MiB instead of
//     one per 4 KiB. Their length is not rounded up: the tail past the last whole huge page
//     is in base pages, so a block costs its size in RSS.
//
// Every block carries a Category, and the package keeps the bytes mapped per category and
// their peak: the accounting the memory monitor, the ZeRO engine's report and the CPU
// device's allocator share.
//
// A block must be freed exactly once, and no slice of it may be used afterwards (the pages
// are unmapped: a use after Free faults instead of reading stale data). All functions are
// safe for concurrent use.
package arena
