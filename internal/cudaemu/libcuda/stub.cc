// Every driver entry point the cuda-tagged qvd binary links (symbols.txt, from `nm -D
// --undefined-only bin/qvd-cuda`) exists in the emulated libcuda: those that driver.cc does
// not implement are weak stubs (stubs.c, generated from symbols.txt by the Makefile) that
// report the call and return CUDA_ERROR_NOT_SUPPORTED, so a binary loads and a call of an
// unimplemented entry point names itself instead of failing at symbol lookup.
#include <cstdio>
#include <cstdlib>

extern "C" __attribute__((visibility("default"))) void cudaemu_count(const char *kind, const char *name);

extern "C" __attribute__((visibility("hidden"))) int cudaemu_stub(const char *name) {
    fprintf(stderr, "cudaemu: %s is not implemented by the emulated driver\n", name);
    cudaemu_count("unimplemented", name);
    return 801; // CUDA_ERROR_NOT_SUPPORTED
}
