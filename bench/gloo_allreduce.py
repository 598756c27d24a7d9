#!/usr/bin/python3
"""PyTorch's gloo all-reduce, timed as bench/mpi_allreduce.c times MPI_Allreduce.

N processes (one thread each) on this machine form a gloo group over loopback and sum a
buffer of SIZE bytes of fp32 in place. Each size prints one line, as mpi_allreduce does:
bytes, the slowest rank's mean time per call (us), algbw = bytes / time and busbw = algbw *
2(N-1)/N (GB/s), so bench/compare-allreduce.sh parses both alike.

    /usr/bin/python3 bench/gloo_allreduce.py --nproc 4 --iters 10 64MiB
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(s):
    for suffix, mult in UNITS.items():
        if s.endswith(suffix):
            return int(s[: -len(suffix)]) * mult
    return int(s)


def worker(rank, n, port, sizes, iters, warmup, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    for nbytes in sizes:
        x = torch.full((nbytes // 4,), float(rank + 1))
        for _ in range(warmup):
            dist.all_reduce(x)
        dist.barrier()
        x.fill_(float(rank + 1))
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        per_call = (time.perf_counter() - start) / iters
        # The data check: after `iters` sums of (1..n) starting from rank+1 per element
        # (and warm-up sums before the refill), every element is the same value.
        if not bool((x == x[0]).all()):
            raise SystemExit(f"rank {rank}: wrong all-reduce result")
        t = torch.tensor([per_call], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            out.put((nbytes, t.item()))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("sizes", nargs="+")
    a = ap.parse_args()
    sizes = [parse_size(s) for s in a.sizes]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, a.nproc, port, sizes, a.iters, a.warmup, out)) for r in range(a.nproc)]
    for p in procs:
        p.start()
    n = a.nproc
    print(f"# gloo ranks {n} dtype fp32 iters {a.iters} torch {torch.__version__}")
    print(f"# {'bytes':>12} {'time(us)':>12} {'algbw':>10} {'busbw':>10}")
    for _ in sizes:
        nbytes, t = out.get()
        alg = nbytes / t / 1e9
        print(f"  {nbytes:12d} {t * 1e6:12.1f} {alg:10.3f} {alg * 2.0 * (n - 1) / n:10.3f}", flush=True)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a gloo worker exited {p.exitcode}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
