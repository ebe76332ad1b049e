#!/usr/bin/env python3
"""The PyTorch reference of the KJV GPT (tests/system/gpt_reference.py's model,
initialisation, training windows and held-out windows) trained on a CUDA device,
for a step-time and tokens/s comparison with lockstep_train --set=device=cuda:0.

    python3 tests/gpu/gpt_reference_cuda.py [--steps 1000] [--device cuda:0] [--token-dir build/data/kjv]

gpt_reference.py itself has no device option (its forward makes its position
and mask tensors with torch.arange / torch.ones on the default device), so its
module here sees a `torch` whose arange and ones default to --device (no
TorchFunctionMode, so no per-op overhead is added). Plain PyTorch:
torch.optim.AdamW with its default implementation, float32 with PyTorch's
default matmul precision (no TF32, as libtorch's default), no torch.compile.
Prints "step N: train loss X (T tokens/s)" every --summary steps (timed with
torch.cuda.synchronize), "step N: test loss X" at the end, and a last line
"reference: ..." with the mean tokens/s after the first summary period.
"""
import argparse
import importlib.util
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _FactoriesOn:
    """torch, with arange and ones on `device` unless told otherwise."""

    def __init__(self, device):
        self._device = device

    def __getattr__(self, name):
        return getattr(torch, name)

    def arange(self, *args, **kwargs):
        kwargs.setdefault("device", self._device)
        return torch.arange(*args, **kwargs)

    def ones(self, *args, **kwargs):
        kwargs.setdefault("device", self._device)
        return torch.ones(*args, **kwargs)


def load_reference():
    path = os.path.join(ROOT, "tests", "system", "gpt_reference.py")
    spec = importlib.util.spec_from_file_location("gpt_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--token-dir", default=os.path.join(ROOT, "build", "data", "kjv"))
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--final-fraction", type=float, default=0.1)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--summary", type=int, default=100)
    p.add_argument("--eval-batch", type=int, default=128)
    args = p.parse_args()

    ref = load_reference()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    ref.torch = _FactoriesOn(dev)  # the model's own arange / ones land on `dev`
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    torch.manual_seed(args.seed)
    tokens = torch.frombuffer(bytearray(open(os.path.join(args.token_dir, "train.bin"), "rb").read()),
                              dtype=torch.uint8).long()
    held_out = torch.frombuffer(bytearray(open(os.path.join(args.token_dir, "eval.bin"), "rb").read()),
                                dtype=torch.uint8).long()
    t = args.context
    model = ref.Gpt(256, t, args.layers, args.heads, args.width)
    ref.init_like_lockstep(model, args.layers)  # on the CPU generator, as gpt_reference.py train does
    model.to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, args.beta2), eps=1e-8,
                                  weight_decay=args.weight_decay)
    windows = (len(tokens) - 1) // t
    batches_per_epoch = max(1, windows // args.batch)
    decay_steps = max(1, args.steps - args.warmup)

    def lr_at(step):
        factor = (step + 1) / args.warmup if args.warmup > 0 and step < args.warmup else 1.0
        progress = min(1.0, max(0.0, (step - args.warmup) / decay_steps))
        return args.lr * factor * (args.final_fraction + (1 - args.final_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))

    def evaluate():
        model.eval()
        n = (len(held_out) - 1) // t
        total, count = 0.0, 0
        with torch.no_grad():
            for b in range(0, n, args.eval_batch):
                starts = torch.arange(b, min(n, b + args.eval_batch), device="cpu") * t
                w = torch.stack([held_out[s:s + t + 1] for s in starts.tolist()]).to(dev)
                logits = model(w[:, :-1])
                total += F.cross_entropy(logits.reshape(-1, 256), w[:, 1:].reshape(-1), reduction="sum").item()
                count += w.shape[0] * t
        model.train()
        return total / count

    print(f"reference: torch {torch.__version__}, device {torch.cuda.get_device_name(dev) if cuda else dev}, "
          f"{sum(p.numel() for p in model.parameters())} parameters, TF32 matmul "
          f"{torch.backends.cuda.matmul.allow_tf32}, steps {args.steps}, batch {args.batch}x{t}", flush=True)
    running, seen = 0.0, 0
    rates = []
    sync()
    started = wall = time.perf_counter()
    for step in range(args.steps):
        epoch, batch = divmod(step, batches_per_epoch)
        starts = [ref.window_start(args.seed, epoch, batch, i, len(tokens), t) for i in range(args.batch)]
        w = torch.stack([tokens[s:s + t + 1] for s in starts]).to(dev, non_blocking=True)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), w[:, 1:].reshape(-1))
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        running += loss.item()  # a sync per step, as Lockstep's loss metric is
        seen += 1
        done = step + 1
        if done % args.summary == 0 or done == args.steps:
            sync()
            elapsed = time.perf_counter() - started
            rate = seen * args.batch * t / elapsed
            if done > args.summary:
                rates.append(rate)
            print(f"step {done}: train loss {running / seen:.6f} ({rate:.0f} tokens/s, "
                  f"{1e3 * elapsed / seen:.2f} ms/step)", flush=True)
            running, seen, started = 0.0, 0, time.perf_counter()
    train_wall = time.perf_counter() - wall
    print(f"step {args.steps}: test loss {evaluate():.6f}", flush=True)
    mean = sum(rates) / len(rates) if rates else float("nan")
    print(f"reference: {args.steps} steps in {train_wall:.1f} s, {mean:.0f} tokens/s after the first "
          f"{args.summary} steps, peak memory "
          f"{torch.cuda.max_memory_allocated(dev) / 2**20 if cuda else float('nan'):.0f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
