"""Compares two files written by `lockstep_ckpt consolidate` (loaded with
torch.load as plain dicts): the parameters ("model/..."), the optimizer state
("optimizer/...") and the step and data position. Exits 0 when they agree,
bit for bit by default or within --rtol relative (max |a - b| / max |b| per
tensor); prints every difference otherwise.

--without-key-bias compares a GPT's fused qkv biases (and their optimizer
state) without their middle third, the key bias: it adds the same amount to every
attention score of a query, which softmax ignores, so its gradient is zero but for
rounding, and Adam turns rounding into full-size steps of either sign. Two runs
whose rounding differs (other ranks, other meshes) part there first.

Usage: /usr/bin/python3 compare_consolidated.py A.pt B.pt [--rtol 1e-5] [--without-key-bias]
"""
import argparse
import sys

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rtol", type=float, default=0.0, help="0: bit for bit")
    p.add_argument("--without-key-bias", action="store_true", help="leave out the key third of qkv biases")
    args = p.parse_args()
    a, b = torch.load(args.a), torch.load(args.b)
    keys = lambda d: {k for k in d if k.startswith(("model/", "optimizer/")) or k in ("step", "data/epoch", "data/batch_in_epoch")}
    problems = []
    if keys(a) != keys(b):
        problems.append(f"keys differ: {sorted(keys(a) ^ keys(b))}")
    compared = 0
    worst = 0.0
    for key in sorted(keys(a) & keys(b)):
        x, y = a[key], b[key]
        compared += 1
        if not torch.is_tensor(x):
            if x != y:
                problems.append(f"{key}: {x} vs {y}")
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            problems.append(f"{key}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
            continue
        if args.without_key_bias and "qkv.bias" in key and x.dim() == 1 and x.numel() % 3 == 0:
            w = x.numel() // 3
            x, y = torch.cat([x[:w], x[2 * w:]]), torch.cat([y[:w], y[2 * w:]])
        if args.rtol == 0:
            if not torch.equal(x, y):
                problems.append(f"{key}: not bit-identical (max |diff| {(x.double() - y.double()).abs().max().item():.3g})")
            continue
        scale = max(y.double().abs().max().item(), 1e-30) if y.numel() else 1.0
        rel = (x.double() - y.double()).abs().max().item() / scale if x.numel() else 0.0
        worst = max(worst, rel)
        if rel > args.rtol:
            problems.append(f"{key}: relative difference {rel:.3g} > {args.rtol}")
    for line in problems:
        print(line)
    if problems:
        return 1
    how = "bit-identical" if args.rtol == 0 else f"within {args.rtol} (worst {worst:.2g})"
    print(f"{compared} values {how}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
