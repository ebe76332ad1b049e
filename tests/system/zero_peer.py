#!/usr/bin/python3
"""The PyTorch side of the independent-peer test of Lockstep's sharded strategies
(tests/multirank/zero_peer_test.cc): PyTorch's own ZeRO-1, DDP with
torch.distributed.optim.ZeroRedundancyOptimizer(Adam) over gloo, trains an MLP,
and the C++ test checks that Lockstep, started from the same parameters on the
same batches, ends with the same parameters.

    /usr/bin/python3 tests/system/zero_peer.py OUT_DIR [--lr 0.01] [--steps 5]

Writes, with torch.save (dicts of tensors, which libtorch's pickle_load reads):
  OUT_DIR/zero_peer_inputs.pt  "init/<name>": the initial parameters (seeded);
                               "inputs/<step>", "targets/<step>": each step's
                               global batch; "lr", "world_size", "steps"
  OUT_DIR/zero_peer_final.pt   "<name>": the parameters after the last step;
                               "losses": each step's mean loss over the global batch
The MLP is 13-29-23-7 with ReLUs (torch.nn.Sequential, so its parameter names are
those of a libtorch Sequential); no parameter's element count divides by 2 or 3.
The global batch (10 examples) is split in halves: rank r trains on rows
[5r, 5r + 5) with the mean cross-entropy over its half, and DDP averages the
gradients, so each step follows the gradient of the mean over the global batch,
as Lockstep's Trainer normalises by the global batch's weight.
"""
import argparse
import os
import socket
import sys

WORLD = 2
IN, HIDDEN1, HIDDEN2, CLASSES = 13, 29, 23, 7
GLOBAL_BATCH = 10


def build_model(torch):
    nn = torch.nn
    return nn.Sequential(nn.Linear(IN, HIDDEN1), nn.ReLU(), nn.Linear(HIDDEN1, HIDDEN2), nn.ReLU(),
                         nn.Linear(HIDDEN2, CLASSES))


def worker(rank, args, port):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    inputs = torch.load(os.path.join(args.out_dir, "zero_peer_inputs.pt"))
    module = build_model(torch)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(inputs[f"init/{name}"])
    model = torch.nn.parallel.DistributedDataParallel(module)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=args.lr)
    half = GLOBAL_BATCH // WORLD
    losses = []
    for step in range(args.steps):
        x = inputs[f"inputs/{step}"][rank * half:(rank + 1) * half]
        y = inputs[f"targets/{step}"][rank * half:(rank + 1) * half]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()  # this rank's share of the parameters, then broadcast to all
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / WORLD)
    if rank == 0:
        final = {name: p.detach().clone() for name, p in module.named_parameters()}
        final["losses"] = torch.tensor(losses, dtype=torch.float64)
        torch.save(final, os.path.join(args.out_dir, "zero_peer_final.pt"))
    dist.barrier()
    # Skip the process group's teardown: ProcessGroupGloo's destructor can deadlock
    # at exit in torch 1.13 (benchmarks/ddp_benchmark.py says so too).
    sys.stdout.flush()
    os._exit(0)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Started from an MPI rank, this process may be bound to one core: free it.
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    import torch
    import torch.multiprocessing as mp

    torch.manual_seed(0)
    module = build_model(torch)
    saved = {f"init/{name}": p.detach().clone() for name, p in module.named_parameters()}
    for step in range(args.steps):
        saved[f"inputs/{step}"] = torch.randn(GLOBAL_BATCH, IN)
        saved[f"targets/{step}"] = torch.randint(CLASSES, (GLOBAL_BATCH,))
    saved["lr"] = torch.tensor(args.lr, dtype=torch.float64)
    saved["world_size"] = torch.tensor(WORLD)
    saved["steps"] = torch.tensor(args.steps)
    os.makedirs(args.out_dir, exist_ok=True)
    torch.save(saved, os.path.join(args.out_dir, "zero_peer_inputs.pt"))
    mp.start_processes(worker, args=(args, free_port()), nprocs=WORLD, join=True, start_method="spawn")
    print(f"zero_peer: {args.steps} steps of DDP + ZeroRedundancyOptimizer(Adam, lr {args.lr}) on {WORLD} ranks; "
          f"wrote {args.out_dir}/zero_peer_final.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
