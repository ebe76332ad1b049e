#!/usr/bin/python3
"""The PyTorch reference of Lockstep's GPT (include/lockstep/gpt.h), written
independently against its description: the same parameter names and shapes, so
that a state dict Lockstep writes loads into it as it is.

    gpt_reference.py parity IN.pt OUT.pt
    gpt_reference.py train --token-dir build/data/kjv [--steps 2000 ...]   (--help)

train: the KJV job of configs/kjv_gpt.textproto in plain PyTorch, from its own
initial weights (drawn as Lockstep draws them, from torch's generator) on the same
training windows (Lockstep's hash of seed, epoch, batch and example) and the same
held-out windows; prints the train loss every --summary steps and the held-out
loss every --eval-every steps and at the end, as "step N: test loss X".

IN.pt (written by tests/unit/gpt_test.cc with libtorch's pickle_save) holds the
sizes ("config/<field>", int64 scalars), the optimizer's settings
("adamw/<field>", float64 scalars), the initial parameters ("model/<name>") and
the batches ("inputs/<s>", "targets/<s>", int64 [B, T]). This script loads the
parameters, takes one torch.optim.AdamW step per batch with the mean
cross-entropy over all tokens, and writes OUT.pt: "losses" (float64, the loss
before each step) and "final/<name>" (the parameters after the last step).
"""
import argparse
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.attn_proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp_up = nn.Linear(width, 4 * width)
        self.mlp_down = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(w // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, w)
        x = x + self.attn_proj(y)
        return x + self.mlp_down(F.gelu(self.mlp_up(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab_size, context_length, num_layers, num_heads, width):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, width)
        self.wpe = nn.Embedding(context_length, width)
        self.blocks = nn.ModuleList(Block(width, num_heads) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()  # the head is tied to the embedding


def parity(in_path, out_path):
    data = torch.load(in_path, weights_only=False)  # written by our own test
    cfg = {k.split("/", 1)[1]: int(v) for k, v in data.items() if k.startswith("config/")}
    opt = {k.split("/", 1)[1]: float(v) for k, v in data.items() if k.startswith("adamw/")}
    model = Gpt(cfg["vocab_size"], cfg["context_length"], cfg["num_layers"], cfg["num_heads"], cfg["width"])
    state = {k[len("model/"):]: v for k, v in data.items() if k.startswith("model/")}
    model.load_state_dict(state, strict=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt["lr"], betas=(opt["beta1"], opt["beta2"]),
                                  eps=opt["eps"], weight_decay=opt["weight_decay"])
    steps = sum(1 for k in data if k.startswith("inputs/"))
    losses = []
    for s in range(steps):
        x, y = data[f"inputs/{s}"], data[f"targets/{s}"]
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    out = {"losses": torch.tensor(losses, dtype=torch.float64)}
    for name, p in model.named_parameters():
        out["final/" + name] = p.detach().clone()
    torch.save(out, out_path)


MASK = (1 << 64) - 1


def mix(x):
    """SplitMix64's finaliser, as src/data/token_data.cc computes it."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def window_start(seed, epoch, batch, example, n_tokens, length):
    h = mix(seed)
    h = mix(h ^ epoch)
    h = mix(h ^ batch)
    h = mix(h ^ example)
    return h % (n_tokens - length)


def init_like_lockstep(model, num_layers):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            elif name.endswith("attn_proj.weight") or name.endswith("mlp_down.weight"):
                p.normal_(0.0, 0.02 / math.sqrt(2 * num_layers))
            else:
                p.normal_(0.0, 0.02)


def train(args):
    import time
    torch.manual_seed(args.seed)
    tokens = torch.frombuffer(bytearray(open(os.path.join(args.token_dir, "train.bin"), "rb").read()),
                              dtype=torch.uint8).long()
    held_out = torch.frombuffer(bytearray(open(os.path.join(args.token_dir, "eval.bin"), "rb").read()),
                                dtype=torch.uint8).long()
    t = args.context
    model = Gpt(256, args.context, args.layers, args.heads, args.width)
    init_like_lockstep(model, args.layers)  # on the CPU generator, wherever the model then goes
    device = torch.device(args.device)
    model.to(device)
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
                starts = torch.arange(b, min(n, b + args.eval_batch)) * t
                w = torch.stack([held_out[s:s + t + 1] for s in starts.tolist()]).to(device)
                logits = model(w[:, :-1])
                total += F.cross_entropy(logits.reshape(-1, 256), w[:, 1:].reshape(-1), reduction="sum").item()
                count += w.shape[0] * t
        model.train()
        return total / count

    running, seen, started = 0.0, 0, time.perf_counter()
    first, timed_tokens, timed_seconds = time.perf_counter(), 0, 0.0
    for step in range(args.steps):
        epoch, batch = divmod(step, batches_per_epoch)
        starts = [window_start(args.seed, epoch, batch, i, len(tokens), t) for i in range(args.batch)]
        w = torch.stack([tokens[s:s + t + 1] for s in starts]).to(device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad()
        logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), w[:, 1:].reshape(-1))
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        running += loss.item()
        seen += 1
        done = step + 1
        if done % args.summary == 0:
            elapsed = time.perf_counter() - started  # loss.item() waited for the step's kernels
            print(f"step {done}: train loss {running / seen:.6f} ({seen * args.batch * t / elapsed:.0f} tokens/s)",
                  flush=True)
            if done > args.summary:  # after the first period (warm-up)
                timed_tokens += seen * args.batch * t
                timed_seconds += elapsed
            running, seen, started = 0.0, 0, time.perf_counter()
        if (args.eval_every > 0 and done % args.eval_every == 0) or done == args.steps:
            print(f"step {done}: test loss {evaluate():.6f}", flush=True)
            started = time.perf_counter()
    memory = f", peak memory {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB" if device.type == "cuda" else ""
    rate = f", {timed_tokens / timed_seconds:.0f} tokens/s after the first {args.summary} steps" if timed_seconds else ""
    print(f"reference: torch {torch.__version__} on {device}, {args.steps} steps in {time.perf_counter() - first:.1f} s"
          f"{rate}{memory}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("parity")
    p.add_argument("input")
    p.add_argument("output")
    t = sub.add_parser("train")
    t.add_argument("--token-dir", default="build/data/kjv")
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--width", type=int, default=128)
    t.add_argument("--context", type=int, default=64)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--final-fraction", type=float, default=0.1)
    t.add_argument("--beta2", type=float, default=0.99)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=42)
    t.add_argument("--summary", type=int, default=100)
    t.add_argument("--eval-every", type=int, default=500)
    t.add_argument("--eval-batch", type=int, default=128)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--device", default="cpu", help="cpu or cuda:N (the initial weights are drawn on the CPU)")
    args = parser.parse_args()
    torch.set_num_threads(getattr(args, "threads", 1))
    if args.command == "parity":
        parity(args.input, args.output)
    else:
        train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
