#!/usr/bin/python3
"""PyTorch side of the CPU training comparison (bench/compare-train.sh): the models, training
step and data path of `qvd train -c configs/fashion-{mlp,cnn,vit}.yaml`, timed step by step.

Usage (use the system python3, which has Debian's PyTorch):
  /usr/bin/python3 bench/torch_train.py --model mlp                 # 20 warm-up + 300 timed steps
  /usr/bin/python3 bench/torch_train.py --model cnn --steps 200 --threads 2
  /usr/bin/python3 bench/torch_train.py --model mlp --world 4 --batch 16   # DDP, 4 x 16 = 64
  /usr/bin/python3 bench/torch_train.py --model vit --hflip --steps 200
  /usr/bin/python3 bench/torch_train.py --model cnn --epochs 1      # train, print test accuracy

Models (ReLU; NCHW; Flatten in NCHW order):
  mlp      784-256-128-10                                  (configs/fashion-mlp.yaml)
  cnn      conv3x3(1->16,same)-pool2-conv3x3(16->32,same)-pool2-1568-128-10 (configs/fashion-cnn.yaml)
  mlp-big  784-4096-4096-4096-10 (36.8M parameters)
  vit      configs/fashion-vit.yaml's ViT: patch 7 (16 tokens + a class token), dim 64, depth 6,
           heads 4, mlp_ratio 2, dropout 0 (~205k parameters), the exact PyTorch twin of qvd's
           (build_vit of scripts/torch_interop.py)

One step, as qvd's: select the batch (index_select from the in-memory, normalised data set by
a random permutation per epoch), forward, CrossEntropyLoss (mean), zero_grad(set_to_none),
backward, clip_grad_norm_(1.0), AdamW(lr 1e-3, betas (0.9, 0.999), eps 1e-8, wd 1e-4).step(),
with the configs' learning-rate schedule (linear warm-up over 200 steps, cosine decay to 0.01
of the base lr over the run; --schedule constant turns it off). Each whole step is timed with
time.perf_counter. The vit model takes fashion-vit.yaml's lr 2e-3, wd 0.05 and 500 warm-up
steps instead. --hflip mirrors each sample of the batch left to right with probability 1/2,
drawn per step (fashion-vit.yaml's augment: {hflip: true}; qvd draws per sample and epoch from
its own generator, so the flips are not the same ones, only as many).

Allocator: by default (--malloc tuned) the script runs with GLIBC_TUNABLES set so that glibc
reuses freed memory instead of returning it to the kernel (see MALLOC_TUNABLES below); an
existing GLIBC_TUNABLES is left as it is. --malloc default runs with glibc's defaults.

Output: one JSON line on stdout,
  {"impl":"torch","model":"cnn","batch":64,"threads":2,"world":1,"steps":300,
   "samples_per_sec_median":..., "samples_per_sec_mean":..., "seconds":..., ...}
where batch is the global batch, the median is over the per-step rates (global batch / step
time) of the timed steps and the mean is total samples / total time of the timed steps.
Diagnostics (losses, accuracy) go to stderr.

--world N runs N processes (torch.multiprocessing spawn, gloo on 127.0.0.1, a free port) with
DistributedDataParallel; --batch is then the micro-batch of each rank (global = N x batch), each
rank takes its disjoint slice of the global batch from the same permutation, and each uses
max(1, cores // N) threads unless --threads says otherwise. Rank 0 times the steps after a
barrier and prints the JSON line with the global samples/s.

Threads: torch.set_num_threads sets the OpenMP pool (oneDNN convolutions, elementwise ops);
Debian's PyTorch does its matrix products in OpenBLAS (pthreads), whose pool is sized by
OPENBLAS_NUM_THREADS when the library loads, so this script sets that variable to --blas-threads
(default: $OPENBLAS_NUM_THREADS if set, else --threads) before importing torch. The two pools
are separate, and the one that has just finished spins a while before it sleeps: on 2 cores the
count that suits one model may not suit another, hence --blas-threads.
"""
import argparse
import datetime
import gzip
import json
import math
import os
import socket
import statistics
import struct
import sys
import time

MEAN, STD = 0.2860, 0.3530
DATA = "/usr/share/datasets/fashion-mnist"
# The configs' optimizer and schedule: (lr, weight decay, warm-up steps) of the AdamW and the
# warmup_cosine schedule (min_ratio 0.01 in all).
HPARAMS = {"vit": (2e-3, 0.05, 500)}          # configs/fashion-vit.yaml
HPARAMS_DEFAULT = (1e-3, 1e-4, 200)           # configs/fashion-{mlp,cnn}.yaml
SCHED_MIN_RATIO = 0.01
# configs/fashion-vit.yaml's model, as scripts/torch_interop.py's spec.
VIT_SPEC = {"type": "vit", "input": [1, 28, 28], "classes": 10, "patch": 7, "dim": 64, "depth": 6,
            "heads": 4, "mlp_ratio": 2, "dropout": 0}
# glibc malloc serves blocks of 128 KiB and more with fresh mmaps and unmaps them on free, so
# each step's activation, gradient and optimizer temporaries page-fault their memory in anew
# (4.7x the step time of the MLP on the development VM). These keep freed memory for reuse, as
# jemalloc/tcmalloc, which PyTorch's CPU tuning guides recommend, do.
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["mlp", "cnn", "mlp-big", "vit"], default="mlp")
    ap.add_argument("--channels", default="32,64",
                    help="the CNN's two conv widths (configs/fashion-cnn.yaml's model.channels)")
    ap.add_argument("--batch", type=int, default=64, help="batch per process (global = world x batch)")
    ap.add_argument("--steps", type=int, default=300, help="timed steps")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps before the timed ones")
    ap.add_argument("--threads", type=int, default=0,
                    help="threads per process (default: all cores, or cores // world with --world)")
    ap.add_argument("--blas-threads", type=int, default=0,
                    help="OpenBLAS threads per process (default: $OPENBLAS_NUM_THREADS, else --threads)")
    ap.add_argument("--world", type=int, default=1, help="DDP processes (gloo)")
    ap.add_argument("--epochs", type=int, default=0,
                    help="train this many epochs on the real data and print test accuracy instead of timing")
    ap.add_argument("--data", default=DATA, help="directory of the Fashion-MNIST IDX .gz files")
    ap.add_argument("--random", action="store_true", help="random data of the same shape instead of Fashion-MNIST")
    ap.add_argument("--schedule", choices=["warmup_cosine", "constant"], default="warmup_cosine")
    ap.add_argument("--hflip", action="store_true",
                    help="mirror each training sample left to right with probability 1/2 (data.augment.hflip)")
    ap.add_argument("--malloc", choices=["tuned", "default"], default="tuned",
                    help="tuned: glibc keeps freed memory instead of unmapping it (see the top of the file)")
    ap.add_argument("--seed", type=int, default=42)
    a = ap.parse_args()
    chans = [int(c) for c in a.channels.split(",") if c.strip().isdigit()]
    if len(chans) != 2 or min(chans) < 1:
        ap.error("--channels: want two positive widths, e.g. 32,64")
    if a.batch < 1 or a.steps < 1 or a.warmup < 0 or a.world < 1 or min(a.threads, a.blas_threads, a.epochs) < 0:
        ap.error("--batch, --steps, --world must be >= 1; --warmup, --threads, --blas-threads, --epochs >= 0")
    if a.epochs and a.random:
        ap.error("--epochs needs the real data (drop --random)")
    if a.hflip and a.model.startswith("mlp"):
        ap.error("--hflip needs image-shaped input (cnn, vit)")
    cores = os.cpu_count() or 1
    if a.threads == 0:
        a.threads = max(1, cores // a.world)
    a.blas_threads = a.blas_threads or int(os.environ.get("OPENBLAS_NUM_THREADS") or a.threads)
    return a


# Parse the arguments before importing torch: OpenBLAS sizes its thread pool when it loads,
# and glibc reads GLIBC_TUNABLES when the process starts (so set it and execute this script
# again; spawned DDP workers inherit it).
ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.malloc == "tuned" and "GLIBC_TUNABLES" not in os.environ:
    os.environ["GLIBC_TUNABLES"] = MALLOC_TUNABLES
    os.execv(sys.executable, [sys.executable] + sys.argv)
if ARGS is not None:
    os.environ["OPENBLAS_NUM_THREADS"] = str(ARGS.blas_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def read_idx(path):
    with gzip.open(path, "rb") as f:
        magic = struct.unpack(">I", f.read(4))[0]
        dims = [struct.unpack(">I", f.read(4))[0] for _ in range(magic & 0xFF)]
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).reshape(dims)


def load(a, split, shape):
    """The split as a normalised float32 tensor of shape (n, *shape) and int64 labels."""
    if a.random:
        n = 60000 if split == "train" else 10000
        g = torch.Generator().manual_seed(a.seed + (split == "t10k"))
        return torch.randn((n, *shape), generator=g), torch.randint(0, 10, (n,), generator=g)
    x = read_idx(os.path.join(a.data, f"{split}-images-idx3-ubyte.gz"))
    y = read_idx(os.path.join(a.data, f"{split}-labels-idx1-ubyte.gz"))
    x = x.float().div_(255).sub_(MEAN).div_(STD)
    return x.reshape(len(x), *shape).contiguous(), y.long()


def build(name, channels=(32, 64)):
    if name == "vit":
        # The exact PyTorch twin of qvd's ViT (its layout, pre-norm blocks, exact GELU,
        # LayerNorm eps 1e-6, truncated-normal class token and position embeddings).
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
        from torch_interop import build_vit
        return build_vit(VIT_SPEC)
    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    if name == "mlp-big":
        return nn.Sequential(nn.Linear(784, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                             nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))
    c1, c2 = channels
    return nn.Sequential(
        nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(c2 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def lr_factor(kind, s, total, warmup):
    """qvd's trainer.ScheduleConfig.Factor for warmup_cosine (linear warm-up) at step s (0-based)."""
    if kind == "constant":
        return 1.0
    if s < warmup:
        return (s + 1) / warmup
    p = 1.0
    if total > warmup:
        p = min(1.0, (s - warmup) / (total - warmup))
    return SCHED_MIN_RATIO + (1 - SCHED_MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * p))


def run(rank, a, port):
    """One process: rank of a.world (world 1: no process group)."""
    world = a.world
    torch.set_num_threads(a.threads)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        train(rank, a)
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def train(rank, a):
    world = a.world
    shape = (784,) if a.model.startswith("mlp") else (1, 28, 28)
    xtr, ytr = load(a, "train", shape)
    torch.manual_seed(a.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    net = build(a.model, tuple(int(c) for c in a.channels.split(",")))
    nparams = sum(p.numel() for p in net.parameters())
    model = nn.parallel.DistributedDataParallel(net) if world > 1 else net
    params = list(model.parameters())
    base_lr, wd, sched_warmup = HPARAMS.get(a.model, HPARAMS_DEFAULT)
    opt = torch.optim.AdamW(params, lr=base_lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    loss_fn = nn.CrossEntropyLoss()
    model.train()

    glob = a.batch * world            # global batch
    per_epoch = len(xtr) // glob      # steps per epoch (the last partial batch is dropped)
    total = a.epochs * per_epoch if a.epochs else a.warmup + a.steps
    gen = torch.Generator().manual_seed(a.seed)  # same permutation on every rank
    lo, hi = rank * a.batch, (rank + 1) * a.batch
    perm = None
    losses = []

    def step(s):
        nonlocal perm
        k = s % per_epoch
        if k == 0:
            perm = torch.randperm(len(xtr), generator=gen)
        idx = perm[k * glob + lo:k * glob + hi]
        x, y = xtr.index_select(0, idx), ytr.index_select(0, idx)
        if a.hflip:
            flip = torch.rand(len(idx), generator=gen) < 0.5
            x = torch.where(flip.view(-1, *([1] * (x.dim() - 1))), x.flip(-1), x)
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        lr = base_lr * lr_factor(a.schedule, s, total, sched_warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        losses.append(loss.item())

    if a.epochs:
        t0 = time.perf_counter()
        for s in range(total):
            step(s)
            if rank == 0 and (s + 1) % per_epoch == 0:
                e = (s + 1) // per_epoch
                log(f"epoch {e}: mean loss {statistics.fmean(losses[-per_epoch:]):.4f}, "
                    f"{time.perf_counter() - t0:.1f} s")
        if world > 1:
            dist.barrier()
        if rank == 0:
            el = time.perf_counter() - t0
            acc, tloss = evaluate(net, a, shape)
            print(json.dumps({"impl": "torch", "torch": torch.__version__, "model": a.model, "params": nparams,
                              "batch": glob, "threads": a.threads, "blas_threads": a.blas_threads,
                              "malloc": os.environ.get("GLIBC_TUNABLES", "default"), "world": world, "hflip": a.hflip, "epochs": a.epochs,
                              "steps": total, "seconds": round(el, 3), "samples_per_sec_mean": total * glob / el,
                              "test_accuracy": acc, "test_loss": tloss}), flush=True)
        return

    for s in range(a.warmup):
        step(s)
    if world > 1:
        dist.barrier()
    times = []
    t0 = time.perf_counter()
    for s in range(a.warmup, a.warmup + a.steps):
        ts = time.perf_counter()
        step(s)
        times.append(time.perf_counter() - ts)
    el = time.perf_counter() - t0
    if world > 1:
        dist.barrier()
    if rank == 0:
        rates = [glob / t for t in times]
        k = min(20, len(losses) // 2) or 1
        first, last = statistics.fmean(losses[:k]), statistics.fmean(losses[-k:])
        log(f"torch {a.model}: loss {first:.4f} (first {k} steps, rank 0) -> {last:.4f} (last {k})")
        print(json.dumps({"impl": "torch", "torch": torch.__version__, "model": a.model, "params": nparams,
                          "batch": glob, "threads": a.threads, "blas_threads": a.blas_threads,
                              "malloc": os.environ.get("GLIBC_TUNABLES", "default"), "world": world, "hflip": a.hflip, "steps": a.steps,
                          "warmup": a.warmup, "data": "random" if a.random else "fashion-mnist",
                          "samples_per_sec_median": statistics.median(rates),
                          "samples_per_sec_min": min(rates), "samples_per_sec_max": max(rates),
                          "samples_per_sec_mean": a.steps * glob / el, "seconds": round(el, 4),
                          "loss_first": first, "loss_last": last}), flush=True)


@torch.no_grad()
def evaluate(net, a, shape):
    xte, yte = load(a, "t10k", shape)
    net.eval()
    correct, tloss = 0, 0.0
    for i in range(0, len(xte), 1000):
        out = net(xte[i:i + 1000])
        tloss += nn.functional.cross_entropy(out, yte[i:i + 1000], reduction="sum").item()
        correct += (out.argmax(1) == yte[i:i + 1000]).sum().item()
    net.train()
    return correct / len(xte), tloss / len(xte)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    a = ARGS
    if a.world == 1:
        run(0, a, 0)
        return
    # gloo picks its interface from the hostname unless told; keep everything on loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # mp.spawn joins all processes; if one fails it terminates the others and raises, which
    # exits non-zero with the failing rank's traceback.
    mp.spawn(run, args=(a, free_port()), nprocs=a.world, join=True)


if __name__ == "__main__":
    main()
