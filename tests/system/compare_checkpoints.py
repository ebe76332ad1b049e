"""Exits 0 when two Lockstep checkpoint step directories hold the same shards:
every rank's shard, loaded with torch.load, has the same keys and bitwise-equal
tensors and values. Prints the differences otherwise.

Usage: /usr/bin/python3 compare_checkpoints.py STEP_DIR_A STEP_DIR_B
"""
import glob
import os
import sys

import torch


def main():
    a_dir, b_dir = sys.argv[1], sys.argv[2]
    a_files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(a_dir, "shard_*.pt")))
    b_files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(b_dir, "shard_*.pt")))
    if not a_files or a_files != b_files:
        print(f"shard files differ: {a_files} vs {b_files}")
        return 1
    problems = []
    for name in a_files:
        a = torch.load(os.path.join(a_dir, name))
        b = torch.load(os.path.join(b_dir, name))
        if set(a) != set(b):
            problems.append(f"{name}: keys differ: {sorted(set(a) ^ set(b))}")
            continue
        for key in sorted(a):
            x, y = a[key], b[key]
            if torch.is_tensor(x):
                same = torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
            else:
                same = x == y
            if not same:
                problems.append(f"{name}: {key} differs")
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
