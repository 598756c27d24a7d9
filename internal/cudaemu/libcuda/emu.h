// Internal interfaces of the emulated driver: the kernel table (generated from kernels.cu by
// ../gen), the block executor (exec.cc) and the allocation registry the executor asks about a
// faulting address (driver.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace cudaemu {

struct ParamInfo {
    const char *name; // as kernels.cu spells it
    const char *type; // as kernels.cu spells it, after macro expansion
    bool ptr;
    size_t size;      // bytes of the parameter (what cuLaunchKernel copies from kernelParams[i])
    size_t elem;      // bytes of the pointee for pointers
};

struct KernelInfo {
    const char *name;
    unsigned maxThreads; // __launch_bounds__, 1024 without
    int nparams;
    const ParamInfo *params;
    void (*run)(void **params); // one thread's body: unpacks params by the C signature
};

extern const KernelInfo kernelTable[];
extern const int kernelCount;
extern const char kernelsSHA256[]; // of the kernels.cu compiled in

const KernelInfo *findKernel(const char *name);

struct Dim {
    unsigned x, y, z;
};

// runLaunch runs every block of a launch on the calling thread. It returns false with msg set
// when a thread faulted (out-of-bounds access, stack overflow, division by zero) or a
// barrier could not complete.
bool runLaunch(const KernelInfo *k, Dim grid, Dim block, void **params, std::string &msg);

// Installs the fault handlers (once); the previous handlers keep every other fault.
void installFaultHandlers();

// describeAddress names the allocation near addr (in a guard zone or its slack), for a fault
// report: "12 bytes past the end of the 4000-byte device allocation at 0x...".
std::string describeAddress(uintptr_t addr);

} // namespace cudaemu
