// C reference for qvd's CPU optimizer step (optim/adam.go over internal/vec/adam.go):
// AdamW and Adam with L2 weight decay over n float32 parameters, gradients and moments, split
// across OpenMP threads, with the per-element operations in exactly internal/vec/adam.go's order.
// Built by bench/run-adamw.sh with -O3 -march=native -fno-math-errno -fopenmp, once with the
// compiler's default floating-point contraction (GCC fuses b1*m + c1*g and b2*v + (c2*g)*g into
// FMAs) and once with -ffp-contract=off (then every product is rounded, as in qvd, and the
// results are qvd's bit for bit).
//
// Two streaming kernels give the bound the memory sets on this machine:
//   stream7  the optimizer's traffic without its arithmetic: reads p, g, m, v and writes p, m, v
//            (28 bytes per element), so its elements/s is the most an Adam step can reach;
//   triad    STREAM's a = b + s*c (12 bytes per element counted, as STREAM counts them).
//
// Usage: adamw [--steps N] [--warmup N] [--kernel adamw|adam|stream7|triad|all] [--hugepage] [SIZE...]
// SIZE is a parameter count with an optional K/M/G suffix (powers of two); default 16M 64M.
// The buffers come from posix_memalign, as a C program's would (4 KiB pages where the kernel's
// transparent huge pages are in "madvise" mode); --hugepage maps each one as qvd's
// internal/arena does: 2 MiB-aligned and advised MADV_HUGEPAGE.
// Output: one line per kernel and size, "kernel size threads ms/step Mparams/s GB/s".
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

// Optimizer settings of the Go benchmarks (optim/bench_test.go: DefaultConfig, lr 1e-3,
// gradient scale 1).
static const double kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8, kWD = 0.01, kLR = 1e-3;

// Constants of one step, computed as optim/adam.go's Step does: in double, then rounded.
typedef struct {
  float b1, c1, b2, c2, eps, wd;
  float scale, neg_step, bc2_sqrt, decay;
} adam_consts;

static adam_consts step_consts(long t, int decoupled) {
  adam_consts k;
  k.b1 = (float)kBeta1;
  k.c1 = (float)(1 - kBeta1);
  k.b2 = (float)kBeta2;
  k.c2 = (float)(1 - kBeta2);
  k.eps = (float)kEps;
  k.wd = (float)kWD;
  k.scale = 1.0f;
  double bc1 = 1 - pow(kBeta1, (double)t), bc2 = 1 - pow(kBeta2, (double)t);
  double lr = (double)(float)kLR;
  k.neg_step = (float)(-lr / bc1);
  k.bc2_sqrt = (float)sqrt(bc2);
  k.decay = decoupled ? (float)(1 - lr * kWD) : 1.0f;
  return k;
}

// adamw_step is adamWGeneric in internal/vec/adam.go, statement for statement.
static void adamw_step(float *restrict p, const float *restrict g, float *restrict m,
                       float *restrict v, long n, adam_consts k) {
#pragma omp parallel for schedule(static)
  for (long i = 0; i < n; i++) {
    float pi = p[i] * k.decay;
    float gi = g[i] * k.scale;
    float mi = k.b1 * m[i] + k.c1 * gi;
    float vi = k.b2 * v[i] + (k.c2 * gi) * gi;
    float denom = sqrtf(vi) / k.bc2_sqrt + k.eps;
    p[i] = pi + (k.neg_step * mi) / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

// adam_step is adamL2Generic: Adam with the weight decay added to the gradient.
static void adam_step(float *restrict p, const float *restrict g, float *restrict m,
                      float *restrict v, long n, adam_consts k) {
#pragma omp parallel for schedule(static)
  for (long i = 0; i < n; i++) {
    float pi = p[i];
    float gi = g[i] * k.scale + k.wd * pi;
    float mi = k.b1 * m[i] + k.c1 * gi;
    float vi = k.b2 * v[i] + (k.c2 * gi) * gi;
    float denom = sqrtf(vi) / k.bc2_sqrt + k.eps;
    p[i] = pi + (k.neg_step * mi) / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

static void stream7(float *restrict p, const float *restrict g, float *restrict m,
                    float *restrict v, long n) {
#pragma omp parallel for schedule(static)
  for (long i = 0; i < n; i++) {
    float gi = g[i];
    p[i] += gi;
    m[i] += gi;
    v[i] -= gi;
  }
}

static void triad(float *restrict a, const float *restrict b, const float *restrict c, long n) {
#pragma omp parallel for schedule(static)
  for (long i = 0; i < n; i++) a[i] = b[i] + 0.5f * c[i];
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// fill is optim/bench_test.go's fill: a cheap deterministic pattern of normal values.
static void fill(float *x, long n, float scale) {
#pragma omp parallel for schedule(static)
  for (long i = 0; i < n; i++) x[i] = scale * (float)((int)(i % 1997) - 998) / 998;
}

static int huge_pages;  // --hugepage
#define HUGE_PAGE (2UL << 20)

static size_t huge_len(long n) { return ((size_t)n * sizeof(float) + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1); }

static void *alloc(long n) {
  void *ptr = NULL;
  if (huge_pages) {
    // internal/arena's Alloc: map 2 MiB more than needed, trim to a 2 MiB-aligned range, advise.
    size_t len = huge_len(n);
    char *p = mmap(NULL, len + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      fprintf(stderr, "adamw: cannot map %ld floats\n", n);
      exit(1);
    }
    char *a = (char *)(((uintptr_t)p + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1));
    if (a > p) munmap(p, a - p);
    if (p + len + HUGE_PAGE > a + len) munmap(a + len, p + len + HUGE_PAGE - (a + len));
    madvise(a, len, MADV_HUGEPAGE);
    return a;
  }
  if (posix_memalign(&ptr, 64, (size_t)n * sizeof(float)) != 0) {
    fprintf(stderr, "adamw: out of memory for %ld floats\n", n);
    exit(1);
  }
  return ptr;
}

static void release(void *p, long n) {
  if (huge_pages)
    munmap(p, huge_len(n));
  else
    free(p);
}

static long parse_size(const char *s) {
  char *end;
  long n = strtol(s, &end, 10);
  switch (*end) {
    case 'K': case 'k': n <<= 10; break;
    case 'M': case 'm': n <<= 20; break;
    case 'G': case 'g': n <<= 30; break;
    case '\0': break;
    default: fprintf(stderr, "adamw: bad size %s\n", s); exit(2);
  }
  return n;
}

// run times steps calls of kernel after warmup calls and prints the result line.
static void run(const char *kernel, long n, int warmup, int steps) {
  float *p = alloc(n), *g = alloc(n), *m = alloc(n), *v = alloc(n);
  // Touch every page on the threads that will use it (one NUMA node here, but it is free).
  fill(p, n, 1);
  fill(g, n, 1e-3f);
  memset(m, 0, (size_t)n * sizeof(float));
  memset(v, 0, (size_t)n * sizeof(float));
  int decoupled = strcmp(kernel, "adamw") == 0;
  double bytes = strcmp(kernel, "triad") == 0 ? 12 : 28;
  long t = 0;
  double start = 0;
  for (int s = 0; s < warmup + steps; s++) {
    if (s == warmup) start = now();
    t++;
    if (strcmp(kernel, "adamw") == 0 || strcmp(kernel, "adam") == 0) {
      adam_consts k = step_consts(t, decoupled);
      if (decoupled)
        adamw_step(p, g, m, v, n, k);
      else
        adam_step(p, g, m, v, n, k);
    } else if (strcmp(kernel, "stream7") == 0) {
      stream7(p, g, m, v, n);
    } else {
      triad(p, g, m, n);
    }
  }
  double el = (now() - start) / steps;
  // A checksum of a few elements keeps the compiler from dropping the work, and lets two
  // builds be compared: with -ffp-contract=off it matches qvd's Go loop.
  uint32_t h = 0;
  for (long i = 0; i < n; i += 4099) {
    uint32_t w;
    memcpy(&w, &p[i], 4);
    h = h * 31 + w;
  }
  printf("%-8s %6ldM %3d %9.2f %9.1f %7.2f  # check %08x\n", kernel, n >> 20,
         omp_get_max_threads(), el * 1e3, n / el / 1e6, n * bytes / el / 1e9, h);
  release(p, n);
  release(g, n);
  release(m, n);
  release(v, n);
}

int main(int argc, char **argv) {
  int warmup = 3, steps = 20;
  const char *kernel = "all";
  long sizes[16];
  int nsizes = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      steps = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--warmup") == 0 && i + 1 < argc) {
      warmup = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--kernel") == 0 && i + 1 < argc) {
      kernel = argv[++i];
    } else if (strcmp(argv[i], "--hugepage") == 0) {
      huge_pages = 1;
    } else if (nsizes < 16) {
      sizes[nsizes++] = parse_size(argv[i]);
    }
  }
  if (steps < 1) steps = 1;
  if (nsizes == 0) {
    sizes[nsizes++] = 16L << 20;
    sizes[nsizes++] = 64L << 20;
  }
  const char *all[] = {"adamw", "adam", "stream7", "triad"};
  printf("# kernel    size thr  ms/step  Mparams/s    GB/s\n");
  for (int s = 0; s < nsizes; s++) {
    for (int k = 0; k < 4; k++) {
      if (strcmp(kernel, "all") == 0 || strcmp(kernel, all[k]) == 0) run(all[k], sizes[s], warmup, steps);
    }
  }
  return 0;
}
