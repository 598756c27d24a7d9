/*
 * MPI_Allreduce reference for qvd's `qvd bench allreduce`: the same sizes, the same
 * nccl-tests-style report (algbw = bytes / time, busbw = algbw * 2(N-1)/N), so the two can be
 * compared on one machine in one sitting. Build and run with bench/run-mpi.sh.
 *
 *   mpi_allreduce [--dtype fp32|fp16] [--iters N] [--warmup N] SIZE...   (SIZE like 64MiB)
 *
 * fp16 is sent as 16-bit words with a user-defined sum op (MPI has no standard half type),
 * accumulating in float as qvd does.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

static float h2f(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0) {
        if (m == 0) { u = s; }
        else { float f = ldexpf((float)m, -24); memcpy(&u, &f, 4); u |= s; }
    } else if (e == 31) { u = s | 0x7f800000 | (m << 13); }
    else { u = s | ((e + 112) << 23) | (m << 13); }
    float f; memcpy(&f, &u, 4); return f;
}

static uint16_t f2h(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t s = (u >> 16) & 0x8000; int32_t e = ((u >> 23) & 0xff) - 127 + 15; uint32_t m = u & 0x7fffff;
    if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(s | 0x7c00 | (m ? 0x200 : 0));
    if (e >= 31) return (uint16_t)(s | 0x7c00);
    if (e <= 0) {
        if (e < -10) return (uint16_t)s;
        m |= 0x800000; uint32_t shift = (uint32_t)(14 - e); uint32_t r = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(s | r);
    }
    uint32_t r = (uint32_t)(e << 10) | (m >> 13), rem = m & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) r++;
    return (uint16_t)(s | r);
}

static void sum_f16(void *in, void *inout, int *len, MPI_Datatype *dt) {
    (void)dt;
    uint16_t *a = in, *b = inout;
    for (int i = 0; i < *len; i++) b[i] = f2h(h2f(a[i]) + h2f(b[i]));
}

static long parse_size(const char *s) {
    char *end; double v = strtod(s, &end);
    if (!strcmp(end, "KiB")) v *= 1024; else if (!strcmp(end, "MiB")) v *= 1024 * 1024;
    else if (!strcmp(end, "GiB")) v *= 1024.0 * 1024 * 1024; else if (*end) return -1;
    return (long)v;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n; MPI_Comm_rank(MPI_COMM_WORLD, &rank); MPI_Comm_size(MPI_COMM_WORLD, &n);
    int fp16 = 0, iters = 20, warmup = 3, first = 1;
    for (; first < argc && argv[first][0] == '-'; first++) {
        if (!strcmp(argv[first], "--dtype") && first + 1 < argc) fp16 = !strcmp(argv[++first], "fp16");
        else if (!strcmp(argv[first], "--iters") && first + 1 < argc) iters = atoi(argv[++first]);
        else if (!strcmp(argv[first], "--warmup") && first + 1 < argc) warmup = atoi(argv[++first]);
    }
    MPI_Op op = MPI_SUM; MPI_Datatype dt = MPI_FLOAT; int esize = 4;
    if (fp16) { MPI_Op_create(sum_f16, 1, &op); dt = MPI_UINT16_T; esize = 2; }
    if (rank == 0) printf("# ranks %d dtype %s iters %d\n# %12s %12s %10s %10s\n", n, fp16 ? "fp16" : "fp32", iters, "bytes", "time(us)", "algbw", "busbw");
    for (int a = first; a < argc; a++) {
        long bytes = parse_size(argv[a]);
        if (bytes <= 0) { if (rank == 0) fprintf(stderr, "bad size %s\n", argv[a]); MPI_Abort(MPI_COMM_WORLD, 2); }
        long count = bytes / esize;
        void *buf = malloc((size_t)count * esize);
        if (fp16) { uint16_t *b = buf; for (long i = 0; i < count; i++) b[i] = f2h((float)(i % 17)); }
        else { float *b = buf; for (long i = 0; i < count; i++) b[i] = (float)(i % 17); }
        for (int i = 0; i < warmup; i++) MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, dt, op, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < iters; i++) MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, dt, op, MPI_COMM_WORLD);
        double t = (MPI_Wtime() - t0) / iters, tmax;
        MPI_Reduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            double alg = (double)bytes / tmax / 1e9;
            printf("  %12ld %12.1f %10.3f %10.3f\n", bytes, tmax * 1e6, alg, alg * 2.0 * (n - 1) / n);
        }
        free(buf);
    }
    if (fp16) MPI_Op_free(&op);
    MPI_Finalize();
    return 0;
}
