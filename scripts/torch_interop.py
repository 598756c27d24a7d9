#!/usr/bin/env python3
"""PyTorch twins of qvd's models, for checking weights in both directions.

qvd's layout (model/layout.go, model/spec.go), which the modules below reproduce exactly:
  * tensors are named after their layer, in PyTorch's state_dict convention: conv1.weight,
    conv1.bias, ..., fc1.weight, fc1.bias, ...; model.safetensors holds them as F32, row-major;
  * Linear weights are [out, in] (y = x W^T + b), conv weights [out, in, kH, kW], biases [out];
  * a conv block is Conv2d(kernel k, stride 1, padding k//2) + ReLU + MaxPool2d(2) (floor);
  * Flatten keeps the [C, H, W] order of each sample (torch.flatten(x, 1));
  * the hidden Linear layers are followed by ReLU, the classifier (the last fc) is not;
  * inputs are the pixels p in [0, 255] normalised as ((p / 255) - mean) / std.

Commands (all print one JSON line on stdout):
  eval  --spec JSON --weights FILE.safetensors --data DIR [--subset N] [--mean M --std S]
        [--prefix P] [--logits OUT]
        loads the weights (names optionally carrying the prefix P), runs the test images of
        the IDX dataset in DIR, prints accuracy and mean loss, and writes the logits as raw
        little-endian float32 (N x classes) to OUT.
  init  --spec JSON --seed S --out FILE.safetensors [--prefix P]
        builds the module with PyTorch's default initialisation under torch.manual_seed(S) and
        saves its state_dict (names prefixed with P) as safetensors, written by hand.

--spec is the model as JSON: {"type": "mlp"|"cnn", "input": [C, H, W], "classes": N,
"hidden": [...], "channels": [...], "kernel": K}, the fields of qvd's model config. A new
architecture is one more builder in ARCHS.

No `safetensors` package is needed: the format is an 8-byte little-endian header length, a
JSON header {name: {"dtype", "shape", "data_offsets"}} padded with spaces to a multiple of 8
bytes, then the raw tensor bytes.
"""

import argparse
import array
import gzip
import json
import os
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class Sequential(nn.Module):
    """Runs steps in order; a step is a named module (its parameters appear under that name
    in the state_dict, as qvd names them) or a parameterless function."""

    def __init__(self, steps):
        super().__init__()
        self.plan = []
        for name, step in steps:
            if isinstance(step, nn.Module):
                self.add_module(name, step)
            self.plan.append((name, step))

    def forward(self, x):
        for name, step in self.plan:
            x = getattr(self, name)(x) if isinstance(step, nn.Module) else step(x)
        return x


def relu(x):
    return F.relu(x)


def pool(x):
    return F.max_pool2d(x, 2)


def flatten(x):
    return torch.flatten(x, 1)


def _head(spec, features):
    """The dense part every model ends with: hidden Linear+ReLU layers, then the classifier."""
    steps = [("flatten", flatten)]
    for i, h in enumerate(spec.get("hidden") or []):
        steps += [(f"fc{i + 1}", nn.Linear(features, h)), (f"relu_fc{i + 1}", relu)]
        features = h
    n = len(spec.get("hidden") or []) + 1
    steps.append((f"fc{n}", nn.Linear(features, spec["classes"])))
    return steps


def build_mlp(spec):
    c, h, w = spec["input"]
    return Sequential(_head(spec, c * h * w))


def build_cnn(spec):
    c, h, w = spec["input"]
    k = spec["kernel"]
    steps = []
    for i, ch in enumerate(spec["channels"]):
        steps += [(f"conv{i + 1}", nn.Conv2d(c, ch, k, padding=k // 2)), (f"relu_conv{i + 1}", relu), (f"pool{i + 1}", pool)]
        c, h, w = ch, h // 2, w // 2  # same padding keeps the size; the pool halves it (floor)
    return Sequential(steps + _head(spec, c * h * w))


ARCHS = {"mlp": build_mlp, "cnn": build_cnn}


def build(spec):
    if spec["type"] not in ARCHS:
        sys.exit(f"torch_interop: unknown model type {spec['type']!r} (have {sorted(ARCHS)})")
    return ARCHS[spec["type"]](spec)


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if e["dtype"] != "F32":
            sys.exit(f"torch_interop: {path}: tensor {name} has dtype {e['dtype']}, only F32 is read")
        b, end = e["data_offsets"]
        t = torch.frombuffer(bytearray(data[b:end]), dtype=torch.float32) if end > b else torch.zeros(0)
        out[name] = t.reshape(e["shape"]).clone()
    return out


def write_safetensors(path, tensors, metadata=None):
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, t in tensors.items():
        b = array.array("f", t.detach().to(torch.float32).contiguous().flatten().tolist())
        if sys.byteorder != "little":
            b.byteswap()
        blob = b.tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = struct.unpack(">" + "I" * ndim, raw[4 : 4 + 4 * ndim])
    return torch.frombuffer(bytearray(raw[4 + 4 * ndim :]), dtype=torch.uint8).reshape(dims)


def locate(d, name):
    gz = os.path.join(d, name + ".gz")
    return gz if os.path.exists(gz) else os.path.join(d, name)


def f32(v):
    """v rounded to float32, as qvd holds the normalisation constants."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def cmd_eval(a, spec):
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    net = build(spec)
    state = {k[len(a.prefix) :] if k.startswith(a.prefix) else k: v for k, v in read_safetensors(a.weights).items()}
    net.load_state_dict(state, strict=True)
    net.eval()
    images = read_idx(locate(a.data, "t10k-images-idx3-ubyte"))
    labels = read_idx(locate(a.data, "t10k-labels-idx1-ubyte")).long()
    if a.subset:
        images, labels = images[: a.subset], labels[: a.subset]
    c, h, w = spec["input"]
    # In float64 and then rounded, as qvd's normalisation table computes each value.
    x = ((images.double() / 255 - f32(a.mean)) / f32(a.std)).float().reshape(-1, c, h, w)
    with torch.no_grad():
        logits = torch.cat([net(x[i : i + 500]) for i in range(0, len(x), 500)])
    loss = F.cross_entropy(logits.double(), labels).item()
    correct = int((logits.argmax(1) == labels).sum())
    if a.logits:
        b = array.array("f", logits.flatten().tolist())
        if sys.byteorder != "little":
            b.byteswap()
        with open(a.logits, "wb") as f:
            f.write(b.tobytes())
    print(json.dumps({"samples": len(labels), "correct": correct, "accuracy": correct / len(labels), "loss": loss}))


def cmd_init(a, spec):
    torch.manual_seed(a.seed)
    net = build(spec)
    write_safetensors(a.out, {a.prefix + k: v for k, v in net.state_dict().items()}, {"format": "pt", "producer": "torch_interop.py"})
    print(json.dumps({"tensors": {a.prefix + k: list(v.shape) for k, v in net.state_dict().items()}}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("eval")
    e.add_argument("--weights", required=True)
    e.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    e.add_argument("--subset", type=int, default=0)
    e.add_argument("--mean", type=float, default=0.2860)
    e.add_argument("--std", type=float, default=0.3530)
    e.add_argument("--logits", default="")
    i = sub.add_parser("init")
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--out", required=True)
    for s in (e, i):
        s.add_argument("--spec", required=True, help="the model as JSON")
        s.add_argument("--prefix", default="", help="tensor-name prefix in the file")
    a = p.parse_args()
    spec = json.loads(a.spec)
    {"eval": cmd_eval, "init": cmd_init}[a.cmd](a, spec)


if __name__ == "__main__":
    main()
