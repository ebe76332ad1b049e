"""Loads a Lockstep checkpoint shard with Python PyTorch's torch.load, checks what
it holds, and saves the same dictionary back with torch.save, so that the C++ test
can compare every value bit for bit.

Usage: /usr/bin/python3 torch_load_roundtrip.py SHARD OUT
"""
import sys

import torch


def main():
    shard, out = sys.argv[1], sys.argv[2]
    values = torch.load(shard)
    assert isinstance(values, dict), type(values)
    models = [k for k in values if k.startswith("model/")]
    assert models, "no model/ entries"
    for key in models:
        assert torch.is_tensor(values[key]), key
    assert isinstance(values["step"], int)
    assert isinstance(values["trainer_state"], str)
    assert values["rng/cpu"].dtype == torch.uint8
    print(f"torch.load: {len(values)} entries, step {values['step']}, {len(models)} model tensors")
    torch.save(values, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
