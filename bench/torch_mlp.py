#!/usr/bin/env python3
"""PyTorch side of the GPU engine comparison: the same MLP (784-256-128-10, ReLU), batch size,
optimizer (AdamW, lr 1e-3, wd 1e-4) and precision as `qvd train -c configs/fashion-mlp.yaml
--device cuda`, timed as samples/s over the training steps (forward, backward, optimizer),
and optionally trained for a number of epochs on Fashion-MNIST to compare accuracy.

  python3 bench/torch_mlp.py --batch 64 --precision fp32 --steps 2000
  python3 bench/torch_mlp.py --data DIR --epochs 15          # DIR holds the IDX .gz files

The data are loaded to the GPU once (as qvd's engine uploads each micro-batch, this favours
PyTorch slightly); without --data, random inputs of the same shape are used for timing.
"""
import argparse, gzip, os, struct, time

import torch
import torch.nn as nn


def idx(path):
    with gzip.open(path, "rb") as f:
        magic = struct.unpack(">I", f.read(4))[0]
        dims = [struct.unpack(">I", f.read(4))[0] for _ in range(magic & 0xFF)]
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).reshape(dims)


def load(d, split):
    x = idx(os.path.join(d, f"{split}-images-idx3-ubyte.gz")).float().div(255).sub(0.2860).div(0.3530)
    y = idx(os.path.join(d, f"{split}-labels-idx1-ubyte.gz")).long()
    return x.reshape(len(x), -1), y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32")
    ap.add_argument("--steps", type=int, default=2000, help="timed steps (random data) when --epochs is 0")
    ap.add_argument("--epochs", type=int, default=0)
    ap.add_argument("--data", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(42)
    net = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)).to(dev)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4)
    dt = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[a.precision]
    scaler = torch.amp.GradScaler("cuda", enabled=a.precision == "fp16")
    loss_fn = nn.CrossEntropyLoss()
    if a.data:
        xtr, ytr = (t.to(dev) for t in load(a.data, "train"))
        xte, yte = (t.to(dev) for t in load(a.data, "t10k"))
    else:
        xtr = torch.randn(60000, 784, device=dev)
        ytr = torch.randint(0, 10, (60000,), device=dev)
        xte, yte = xtr[:10000], ytr[:10000]

    def step(x, y):
        with torch.autocast("cuda", dtype=dt, enabled=dt is not None):
            loss = loss_fn(net(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        return loss

    n = len(xtr) // a.batch
    for i in range(20):  # warm-up
        step(xtr[i * a.batch:(i + 1) * a.batch], ytr[i * a.batch:(i + 1) * a.batch])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    steps = a.epochs * n if a.epochs else a.steps
    t0 = time.perf_counter()
    for s in range(steps):
        if s % n == 0:
            perm = torch.randperm(len(xtr), device=dev)
        j = perm[(s % n) * a.batch:(s % n + 1) * a.batch]
        step(xtr[j], ytr[j])
    torch.cuda.synchronize()
    el = time.perf_counter() - t0
    with torch.no_grad(), torch.autocast("cuda", dtype=dt, enabled=dt is not None):
        acc = (net(xte).argmax(1) == yte).float().mean().item()
    print(f"pytorch {torch.__version__} {torch.cuda.get_device_name()} mlp 784-256-128-10 batch {a.batch} {a.precision}: "
          f"{steps} steps in {el:.2f} s = {steps * a.batch / el:,.0f} samples/s, {el / steps * 1e3:.3f} ms/step, "
          f"peak allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB, test accuracy {acc:.4f}")


if __name__ == "__main__":
    main()
