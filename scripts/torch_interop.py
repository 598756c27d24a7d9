#!/usr/bin/env python3
"""PyTorch twins of qvd's models, for checking weights in both directions.

qvd's layout (model/layout.go, model/spec.go, model/layers.go), which the modules below
reproduce exactly:
  * tensors are named after their layer, in PyTorch's state_dict convention: conv1.weight,
    conv1.bias, ..., fc1.weight, fc1.bias, ...; model.safetensors holds them as F32, row-major;
  * Linear weights are [out, in] (y = x W^T + b), conv weights [out, in, kH, kW], biases [out];
  * a conv block is Conv2d(kernel k, stride 1, padding k//2) + ReLU + MaxPool2d(2) (floor);
  * Flatten keeps the [C, H, W] order of each sample (torch.flatten(x, 1));
  * the hidden Linear layers are followed by ReLU, the classifier (the last fc) is not;
  * inputs are the pixels p in [0, 255] normalised as ((p / 255) - mean) / std.
The ViT (type vit) is pre-norm with a class token, named as timm's VisionTransformer:
  * patch_embed.proj: Conv2d(C, dim, kernel = stride = patch), its output [dim, H/p, W/p]
    read as tokens in raster order;
  * cls_token [1, 1, dim] prepended, pos_embed [1, T+1, dim] added, then dropout;
  * blocks.N: x + drop(attn.proj(attention(attn.qkv(norm1(x))))), then
    x + drop(mlp.fc2(drop(gelu(mlp.fc1(norm2(x)))))), norm1/norm2 LayerNorm(eps 1e-6), GELU
    the exact (erf) form; attn.qkv's output is [Q | K | V], each split into heads side by side
    (head h uses features h*dh .. (h+1)*dh); attention is softmax(Q K^T / sqrt(dh)) V;
  * norm (LayerNorm eps 1e-6) on every token, the class token's features into head (Linear).
Type layers is qvd's general list (model.LayerConfig as JSON): dense, conv2d, relu, gelu,
maxpool2, flatten, layernorm, dropout, batchnorm2d (its running_mean and running_var saved,
no num_batches_tracked), patch_embed, tokens, attention (NAME.qkv, NAME.proj), cls_pool,
mean_pool, residual (a branch added to its input) and block; unnamed layers are named as qvd
names them (the type and the layer's index in the expanded list: dense12).

Commands (all print one JSON line on stdout):
  eval  --spec JSON --weights FILE.safetensors --data DIR [--subset N] [--mean M --std S]
        [--prefix P] [--logits OUT]
        loads the weights (names optionally carrying the prefix P), runs the test images of
        the IDX dataset in DIR, prints accuracy and mean loss, and writes the logits as raw
        little-endian float32 (N x classes) to OUT.
  step  --spec JSON --weights FILE.safetensors --lr LR --out FILE.safetensors [--data DIR]
        [--subset N] [--mean M --std S] [--prefix P]
        loads the weights, takes one plain SGD step (w -= LR * grad, by autograd) on the mean
        cross-entropy of the first N training images as one batch, in training mode (batch
        norm on the batch's statistics, updating the running ones; dropout on, so leave it at
        0 to compare), and saves the weights and buffers as safetensors.
  init  --spec JSON --seed S --out FILE.safetensors [--prefix P]
        builds the module with PyTorch's default initialisation under torch.manual_seed(S)
        (a ViT's cls_token and pos_embed: truncated normal, std 0.02, cut at 2 std, as qvd's
        own initialisation draws them) and saves its state_dict (names prefixed with P) as
        safetensors, written by hand.
  names --spec JSON
        prints the state_dict's tensor names and shapes, in order, without weights.

--spec is the model as JSON: {"type": "mlp"|"cnn"|"vit"|"layers", "input": [C, H, W],
"classes": N, "hidden": [...], "channels": [...], "kernel": K, "patch": P, "dim": D,
"depth": L, "heads": H, "mlp_ratio": R, "dropout": Q, "layers": [...]}, the fields of qvd's
model config (a ViT's unset or zero fields take qvd's defaults: ViT-Tiny/16). A new
architecture is one more builder in ARCHS.

No `safetensors` package is needed: the format is an 8-byte little-endian header length, a
JSON header {name: {"dtype", "shape", "data_offsets"}} padded with spaces to a multiple of 8
bytes, then the raw tensor bytes.
"""

import argparse
import array
import gzip
import json
import math
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


def qvd_round(x):
    """Go's math.Round (half away from zero) of x >= 0, as qvd sizes a ViT's MLP."""
    return int(math.floor(x + 0.5))


def put(root, name, module):
    """Registers module under the dotted name ("blocks.0.attn.qkv"), creating empty
    containers for the parents, so its tensors appear in the state_dict as qvd names them."""
    parts = name.split(".")
    m = root
    for p in parts[:-1]:
        if p not in m._modules:
            m.add_module(p, nn.Module())
        m = m._modules[p]
    if parts[-1] in m._modules or parts[-1] in m._parameters:
        sys.exit(f"torch_interop: two layers are named {name!r}")
    m.add_module(parts[-1], module)
    return module


def attend(qkv, heads):
    """Multi-head self-attention on fused projections qkv [N, T, 3D] laid out [Q | K | V],
    head h taking features h*dh .. (h+1)*dh of each: softmax(Q K^T / sqrt(dh)) V, the heads'
    outputs side by side -> [N, T, D]."""
    n, t, d3 = qkv.shape
    d = d3 // 3
    dh = d // heads
    q, k, v = qkv.reshape(n, t, 3, heads, dh).permute(2, 0, 3, 1, 4)  # each [N, heads, T, dh]
    a = torch.softmax(q @ k.transpose(-2, -1) * f32(1 / math.sqrt(dh)), dim=-1)
    return (a @ v).transpose(1, 2).reshape(n, t, d)


def trunc_normal(t, std=0.02):
    """N(0, std^2) truncated at 2 std (qvd's initialisation of the class token and position
    embeddings)."""
    nn.init.trunc_normal_(t, std=std, a=-2 * std, b=2 * std)


# --- ViT (type vit): plain torch.nn modules, named as timm's VisionTransformer -----------------

VIT_DEFAULTS = {"patch": 16, "dim": 192, "depth": 12, "heads": 3, "mlp_ratio": 4.0}  # model/layers.go


def vit_config(spec):
    """The ViT fields of spec with qvd's defaults (model.Config.ViTConfig) for the unset ones."""
    c = {k: spec.get(k) or v for k, v in VIT_DEFAULTS.items()}
    c["dropout"] = spec.get("dropout") or 0.0
    return c


class PatchEmbed(nn.Module):
    def __init__(self, channels, dim, patch):
        super().__init__()
        self.proj = nn.Conv2d(channels, dim, patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)  # [N, D, H/p, W/p] -> [N, T, D], raster order


class Attention(nn.Module):
    def __init__(self, dim, heads, drop):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        return self.drop(self.proj(attend(self.qkv(x), self.heads)))


class Mlp(nn.Module):
    def __init__(self, dim, hidden, drop):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, dim, heads, hidden, drop):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads, drop)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, hidden, drop)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, spec):
        super().__init__()
        c, h, w = spec["input"]
        v = vit_config(spec)
        p, d = v["patch"], v["dim"]
        if h % p or w % p or d % v["heads"]:
            sys.exit(f"torch_interop: vit: patch {p} must divide the {h}x{w} input and heads {v['heads']} the dim {d}")
        tokens = (h // p) * (w // p)
        self.patch_embed = PatchEmbed(c, d, p)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens + 1, d))
        self.pos_drop = nn.Dropout(v["dropout"])
        hidden = qvd_round(v["mlp_ratio"] * d)
        self.blocks = nn.ModuleList([Block(d, v["heads"], hidden, v["dropout"]) for _ in range(v["depth"])])
        self.norm = nn.LayerNorm(d, eps=1e-6)
        self.head = nn.Linear(d, spec["classes"])
        trunc_normal(self.cls_token)
        trunc_normal(self.pos_embed)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.pos_drop(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x)[:, 0])


def build_vit(spec):
    return VisionTransformer(spec)


def vit_layers(spec):
    """The ViT as qvd's layers list (model/layers.go vitLayers), for cross-checking the
    general builder against VisionTransformer."""
    v = vit_config(spec)
    drop = [{"type": "dropout", "p": v["dropout"]}] if v["dropout"] else []
    out = [{"type": "patch_embed", "name": "patch_embed.proj", "out": v["dim"], "patch": v["patch"]}, {"type": "tokens"}] + drop
    for i in range(v["depth"]):
        p = f"blocks.{i}."
        attn = [{"type": "layernorm", "name": p + "norm1"}, {"type": "attention", "name": p + "attn", "heads": v["heads"]}] + drop
        mlp = [{"type": "layernorm", "name": p + "norm2"}, {"type": "dense", "name": p + "mlp.fc1", "out": qvd_round(v["mlp_ratio"] * v["dim"])}, {"type": "gelu"}]
        mlp += drop + [{"type": "dense", "name": p + "mlp.fc2", "out": v["dim"]}] + drop
        out.append({"type": "block", "layers": [{"type": "residual", "layers": attn}, {"type": "residual", "layers": mlp}]})
    return out + [{"type": "layernorm", "name": "norm"}, {"type": "cls_pool"}, {"type": "dense", "name": "head"}]


# --- the layers list (type layers) ---------------------------------------------------------------


class BatchNorm2d(nn.Module):
    """torch.nn.BatchNorm2d (momentum 0.1, the unbiased batch variance into running_var)
    without num_batches_tracked, which qvd does not keep: weight, bias, running_mean,
    running_var."""

    def __init__(self, channels, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.1, self.eps)


class Tokens(nn.Module):
    """Prepends the class token and adds the position embeddings: [N, T, D] -> [N, T+1, D]."""

    def __init__(self, owner, tokens, dim):
        super().__init__()
        owner.register_parameter("cls_token", nn.Parameter(torch.zeros(1, 1, dim)))
        owner.register_parameter("pos_embed", nn.Parameter(torch.zeros(1, tokens + 1, dim)))
        trunc_normal(owner.cls_token)
        trunc_normal(owner.pos_embed)
        self.owner = [owner]  # not a child: its tensors are the owner's

    def forward(self, x):
        o = self.owner[0]
        return torch.cat([o.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + o.pos_embed


class Layers(nn.Module):
    """qvd's layers list (model.LayerConfig entries), expanded as model/layers.go's builder
    expands it: the same shapes, the same tensor names."""

    def __init__(self, spec):
        super().__init__()
        self.classes = spec["classes"]
        self.count = 0  # layers in qvd's expanded list so far (default names carry it)
        self.shape = list(spec["input"])
        self.program = self._build(spec["layers"], "layers")

    def _fail(self, at, lc, msg):
        sys.exit(f"torch_interop: {at} ({lc.get('type')} {lc.get('name', '')}, input {self.shape}): {msg}")

    def _name(self, lc, kind):
        return lc.get("name") or f"{kind}{self.count}"

    def _build(self, lcs, path):
        prog = []
        for i, lc in enumerate(lcs):
            at = f"{path}[{i}]"
            step = self._layer(lc, at, path == "layers" and i == len(lcs) - 1)
            if step is not None:
                prog.append(step)
        return prog

    def _layer(self, lc, at, last):
        t, sh = lc["type"], self.shape
        eps = lambda d: f32(lc.get("eps") or d)
        if t == "dense":
            if len(sh) > 2:
                self._fail(at, lc, "dense needs features or tokens")
            out = lc.get("out") or (self.classes if last else self._fail(at, lc, "out: only the last layer may leave it out"))
            m = put(self, self._name(lc, "dense"), nn.Linear(sh[-1], out))
            self.shape, self.count = sh[:-1] + [out], self.count + 1
            return m
        if t == "conv2d":
            k = lc["kernel"]
            pad = lc["pad"] if lc.get("pad") is not None else k // 2
            m = put(self, self._name(lc, "conv2d"), nn.Conv2d(sh[0], lc["out"], k, padding=pad))
            self.shape, self.count = [lc["out"], sh[1] + 2 * pad - k + 1, sh[2] + 2 * pad - k + 1], self.count + 1
            return m
        if t == "layernorm":
            m = put(self, self._name(lc, "layernorm"), nn.LayerNorm(sh[-1], eps=eps(1e-6)))
            self.count += 1
            return m
        if t == "batchnorm2d":
            m = put(self, self._name(lc, "batchnorm2d"), BatchNorm2d(sh[0], eps(1e-5)))
            self.count += 1
            return m
        if t == "patch_embed":
            p = lc["patch"]
            conv = put(self, self._name(lc, "patch_embed"), nn.Conv2d(sh[0], lc["out"], p, stride=p))
            self.shape, self.count = [(sh[1] // p) * (sh[2] // p), lc["out"]], self.count + 1
            return lambda x: conv(x).flatten(2).transpose(1, 2)
        if t == "tokens":
            owner = self
            if lc.get("name"):
                owner = put(self, lc["name"], nn.Module())
            m = Tokens(owner, sh[0], sh[1])
            self.shape, self.count = [sh[0] + 1, sh[1]], self.count + 1
            return m
        if t == "attention":
            name, d, heads = lc.get("name") or f"attn{self.count}", sh[1], lc["heads"]
            qkv = put(self, name + ".qkv", nn.Linear(d, 3 * d))
            proj = put(self, name + ".proj", nn.Linear(d, d))
            self.count += 3  # qkv, the attention, proj
            return lambda x: proj(attend(qkv(x), heads))
        if t == "dropout":
            p = lc.get("p") or 0.0
            if p == 0:
                return None  # qvd drops it from the list
            self.count += 1
            return lambda x: F.dropout(x, p, self.training)
        if t not in ("residual", "block"):
            self.count += 1  # a layer without parameters: one entry
        if t == "relu":
            return F.relu
        if t == "gelu":
            return F.gelu
        if t == "maxpool2":
            self.shape = [sh[0], sh[1] // 2, sh[2] // 2]
            return pool
        if t == "flatten":
            self.shape = [math.prod(sh)]
            return flatten
        if t == "cls_pool":
            self.shape = [sh[1]]
            return lambda x: x[:, 0]
        if t == "mean_pool":
            self.shape = [sh[0]] if len(sh) == 3 else [sh[1]]
            return (lambda x: x.mean((2, 3))) if len(sh) == 3 else (lambda x: x.mean(1))
        if t == "residual":
            self.count += 1  # the residual marker; its add comes after the branch
            branch = self._build(lc["layers"], at + ".layers")
            self.count += 1
            if self.shape != sh:
                self._fail(at, lc, f"the branch turns {sh} into {self.shape}")
            return lambda x: x + run_program(branch, x)
        if t == "block":
            body = self._build(lc["layers"], at + ".layers")
            return lambda x: run_program(body, x)
        self._fail(at, lc, f"unknown layer type {t!r}")

    def forward(self, x):
        return run_program(self.program, x)


def run_program(prog, x):
    for step in prog:
        x = step(x)
    return x


def build_layers(spec):
    return Layers(spec)


ARCHS = {"mlp": build_mlp, "cnn": build_cnn, "vit": build_vit, "layers": build_layers}


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


def load_module(a, spec):
    """The module of spec with the weights of a.weights (names carrying a.prefix)."""
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    net = build(spec)
    state = {k[len(a.prefix) :] if k.startswith(a.prefix) else k: v for k, v in read_safetensors(a.weights).items()}
    net.load_state_dict(state, strict=True)
    return net


def load_split(a, spec, split, n):
    """The first n (0: all) images of split ("train" or "t10k"), normalised, and their labels."""
    images = read_idx(locate(a.data, f"{split}-images-idx3-ubyte"))
    labels = read_idx(locate(a.data, f"{split}-labels-idx1-ubyte")).long()
    if n:
        images, labels = images[:n], labels[:n]
    c, h, w = spec["input"]
    # In float64 and then rounded, as qvd's normalisation table computes each value.
    return ((images.double() / 255 - f32(a.mean)) / f32(a.std)).float().reshape(-1, c, h, w), labels


def cmd_eval(a, spec):
    net = load_module(a, spec)
    net.eval()
    x, labels = load_split(a, spec, "t10k", a.subset)
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


def cmd_step(a, spec):
    net = load_module(a, spec)
    net.train()
    x, labels = load_split(a, spec, "train", a.subset)
    loss = F.cross_entropy(net(x), labels)  # the batch's mean
    net.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in net.parameters():
            p -= a.lr * p.grad
    write_safetensors(a.out, {a.prefix + k: v for k, v in net.state_dict().items()}, {"format": "pt", "producer": "torch_interop.py"})
    print(json.dumps({"samples": len(labels), "loss": loss.item()}))


def cmd_init(a, spec):
    torch.manual_seed(a.seed)
    net = build(spec)
    write_safetensors(a.out, {a.prefix + k: v for k, v in net.state_dict().items()}, {"format": "pt", "producer": "torch_interop.py"})
    print(json.dumps({"tensors": {a.prefix + k: list(v.shape) for k, v in net.state_dict().items()}}))


def cmd_names(a, spec):
    print(json.dumps({"tensors": [[k, list(v.shape)] for k, v in build(spec).state_dict().items()]}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("eval")
    e.add_argument("--logits", default="")
    st = sub.add_parser("step")
    st.add_argument("--lr", type=float, required=True)
    st.add_argument("--out", required=True)
    for s in (e, st):
        s.add_argument("--weights", required=True)
        s.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
        s.add_argument("--subset", type=int, default=0)
        s.add_argument("--mean", type=float, default=0.2860)
        s.add_argument("--std", type=float, default=0.3530)
    i = sub.add_parser("init")
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--out", required=True)
    n = sub.add_parser("names")
    for s in (e, st, i, n):
        s.add_argument("--spec", required=True, help="the model as JSON")
        s.add_argument("--prefix", default="", help="tensor-name prefix in the file")
    a = p.parse_args()
    spec = json.loads(a.spec)
    {"eval": cmd_eval, "step": cmd_step, "init": cmd_init, "names": cmd_names}[a.cmd](a, spec)


if __name__ == "__main__":
    main()
