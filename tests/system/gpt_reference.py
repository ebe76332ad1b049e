#!/usr/bin/python3
"""The PyTorch reference of Lockstep's GPT (include/lockstep/gpt.h), written
independently against its description: the same parameter names and shapes, so
that a state dict Lockstep writes loads into it as it is.

    gpt_reference.py parity IN.pt OUT.pt

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
        causal = torch.ones(t, t, dtype=torch.bool).tril()
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
        positions = torch.arange(tokens.shape[1])
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()  # the head is tied to the embedding


def parity(in_path, out_path):
    data = torch.load(in_path)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("parity")
    p.add_argument("input")
    p.add_argument("output")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.command == "parity":
        parity(args.input, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
