// The fake driver's exports for the other fakes (libcublas, libnccl): their work runs on the
// driver's streams, checks its allocations and counts into its coverage file. One
// declaration here, included by the driver that defines them and the libraries that call
// them, so the two sides cannot disagree on a signature.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>

extern "C" {
// cudaemu_enqueue queues fn(arg, msg, cap) on stream s; a non-zero result fails the stream
// with msg. del(arg) runs once, whether or not fn ran.
int cudaemu_enqueue(CUstream s, int (*fn)(void *, char *, size_t), void *arg, void (*del)(void *));
// cudaemu_check_range: 0 when [p, p+n) lies in one live allocation, else an error with msg.
int cudaemu_check_range(uintptr_t p, size_t n, char *msg, size_t cap);
// cudaemu_fail makes the context's error sticky, as a faulting kernel would.
void cudaemu_fail(int code, const char *msg);
// cudaemu_count records a call of name (kind: "driver", "cublas", "nccl", ...).
void cudaemu_count(const char *kind, const char *name);
}
