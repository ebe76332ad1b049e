#!/usr/bin/python3
"""The PyTorch DDP half of the scale-out suite: the same models, batches,
optimizer and thread settings as scaleout_benchmark.cc, trained by
torch.nn.parallel.DistributedDataParallel over gloo on 127.0.0.1.

    /usr/bin/python3 benchmarks/ddp_benchmark.py --ranks 2 --model small_mlp --batch-per-rank 32

Starts `--ranks` processes (torch.multiprocessing, spawn; TCP rendezvous on a
free loopback port). Each process: `--threads` intra-op threads and OpenBLAS
single-threaded, as on the Lockstep side; with --process-settings=lockstep
also the rest of Lockstep's ConfigureTorchForTraining (glibc malloc kept off
mmap, denormals flushed); and by default the same core binding as mpirun gives
Lockstep's ranks (rank r on core r when there are enough cores). After warm-up, `rounds`
rounds of steps/rounds DDP steps ("sync") and, on more than one rank, as many
under DDP's no_sync() ("nosync": no all-reduce), a barrier between phases. Then
a forward / backward / optimizer breakdown on the bare module. Rank 0 prints one
JSON object on the last line of stdout, with the same keys as the Lockstep side.

--plain (1 rank): the bare module and optimizer without the DDP wrapper, PyTorch's
plain training loop; "framework" is then "torch_plain". --model gpt: the GPT of
configs/kjv_gpt.textproto (tests/system/gpt_reference.py's model) on random bytes.

--zero: the optimizer is torch.distributed.optim.ZeroRedundancyOptimizer over
the same torch.optim class and settings (ZeRO-1: each rank keeps the state of
its share of the parameters, whole tensors, and broadcasts them after its
update), still under DDP; "framework" is then "ddp_zero". Either way the JSON
has the bytes each rank holds after the timed steps, counted as the Lockstep
side counts them when it does not shard: parameters, their .grad, and the
optimizer's state tensors ("step" counters left out, as libtorch keeps them as
integers); DDP's own bucket buffers are in none of the three.
"""
import argparse
import ctypes
import json
import os
import socket
import statistics
import sys
import time


def pss_now_mib():
    """This process's proportional set size in MiB (shared pages split among their
    users), as scaleout_benchmark reports it; 0 when /proc/self/smaps_rollup is absent."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # as scaleout_benchmark does before reading it
    except OSError:
        pass
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return float(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--model", default="small_mlp", choices=["small_mlp", "wide_mlp", "cnn", "gpt"])
    p.add_argument("--plain", action="store_true",
                   help="1 rank only: the bare module and optimizer, no DDP wrapper (PyTorch's plain loop)")
    p.add_argument("--batch-per-rank", type=int, default=32)
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--steps", type=int, default=40, help="timed steps per phase, spread over the rounds")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--breakdown-steps", type=int, default=10)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (DDP's default: 25)")
    p.add_argument("--zero", action="store_true",
                   help="torch.distributed.optim.ZeroRedundancyOptimizer around the optimizer (ZeRO-1)")
    p.add_argument("--no-nosync", dest="nosync", action="store_false",
                   help="skip the nosync phase (only the sync step time is wanted)")
    p.add_argument("--bind", choices=["core", "none"], default="core",
                   help="core: rank r on core r, as mpirun binds Lockstep's ranks; none: no affinity")
    p.add_argument("--hook", choices=["none", "bf16", "fp16", "powersgd"], default="none",
                   help="DDP communication hook: default_hooks.bf16/fp16_compress_hook or powerSGD_hook")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--powersgd-start", type=int, default=2, help="PowerSGD's start_powerSGD_iter")
    p.add_argument("--rank", type=int, default=None,
                   help="run only this rank, in this process (the ranks started elsewhere, on other hosts); "
                        "with --init-method and --local-rank")
    p.add_argument("--local-rank", type=int, default=0, help="with --rank: this rank's index on its host (binding)")
    p.add_argument("--init-method", default=None, help="with --rank: tcp://HOST:PORT of rank 0")
    p.add_argument("--process-settings", choices=["pytorch", "lockstep"], default="pytorch",
                   help="pytorch: PyTorch as shipped plus the thread settings; lockstep: also the glibc malloc "
                        "settings and denormal flushing of Lockstep's ConfigureTorchForTraining")
    return p.parse_args(argv)


def process_settings(args):
    """Set before torch loads (the spawned ranks inherit the environment)."""
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # as Lockstep: OpenBLAS single-threaded
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if args.process_settings == "lockstep":
        # glibc reads these at process start: keep freed blocks in the heap, never mmap.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(32 << 20)
        os.environ["MALLOC_TRIM_THRESHOLD_"] = str(1 << 30)
        os.environ["MALLOC_MMAP_MAX_"] = "0"


GPT_CONTEXT = 64  # configs/kjv_gpt.textproto's model, as scaleout_benchmark.cc builds it


def build_model(torch, name):
    nn = torch.nn
    if name == "gpt":
        # The same GPT as Lockstep's (tests/system/gpt_reference.py: same names, shapes and init scheme).
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "system"))
        import gpt_reference
        model = gpt_reference.Gpt(256, GPT_CONTEXT, 4, 4, 128)
        gpt_reference.init_like_lockstep(model, 4)
        return model, None, 256
    if name == "small_mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 10)), (1, 28, 28), 10
    if name == "wide_mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                             nn.Linear(4096, 1024)), (1, 32, 32), 1024
    # Lockstep's CnnImpl with ModelOptions{}: hidden 128, 28x28 inputs.
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10)), (1, 28, 28), 10


def worker(rank, args, port, queue):
    import resource

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    cores = os.cpu_count() or 1
    local = rank if args.rank is None else args.local_rank
    if args.bind == "core" and (local + 1) * args.threads <= cores and (args.rank is not None or args.ranks * args.threads <= cores):
        os.sched_setaffinity(0, set(range(local * args.threads, (local + 1) * args.threads)))
    torch.set_num_threads(args.threads)
    if args.process_settings == "lockstep":
        torch.set_flush_denormal(True)
    init_method = args.init_method or f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=args.ranks)

    torch.manual_seed(0)
    module, input_shape, classes = build_model(torch, args.model)
    if args.plain:
        model = module  # the plain loop: no DDP
    else:
        model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=args.bucket_mb)
        if args.hook != "none":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
            if args.hook == "powersgd":
                hook_state = powerSGD_hook.PowerSGDState(
                    process_group=None, matrix_approximation_rank=args.powersgd_rank,
                    start_powerSGD_iter=args.powersgd_start, min_compression_rate=2, use_error_feedback=True,
                    warm_start=True)
                model.register_comm_hook(hook_state, powerSGD_hook.powerSGD_hook)
            else:
                model.register_comm_hook(None, default_hooks.bf16_compress_hook if args.hook == "bf16"
                                         else default_hooks.fp16_compress_hook)
    if args.optimizer == "sgd":
        optimizer_class, settings = torch.optim.SGD, dict(lr=0.01, momentum=0.9)
    else:
        optimizer_class, settings = torch.optim.Adam, dict(lr=1e-3)
    if args.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, **settings)
        local_optimizer = optimizer.optim  # this rank's share
    else:
        optimizer = optimizer_class(model.parameters(), **settings)
        local_optimizer = optimizer
    torch.manual_seed(1000 + rank)
    if args.model == "gpt":  # random bytes, as on the Lockstep side
        batches = [(torch.randint(256, (args.batch_per_rank, GPT_CONTEXT)),
                    torch.randint(256, (args.batch_per_rank, GPT_CONTEXT))) for _ in range(4)]
    else:
        batches = [(torch.randn(args.batch_per_rank, *input_shape), torch.randint(classes, (args.batch_per_rank,)))
                   for _ in range(4)]

    def loss_of(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)) if out.dim() == 3 \
            else F.cross_entropy(out, y)
    step_index = [0]

    def step(sync):
        x, y = batches[step_index[0] % len(batches)]
        step_index[0] += 1
        optimizer.zero_grad()
        if sync:
            loss_of(model(x), y).backward()
        else:
            with model.no_sync():
                loss_of(model(x), y).backward()
        optimizer.step()

    def phase(sync, steps, times):
        for _ in range(steps):
            start = time.perf_counter()
            step(sync)
            if times is not None:
                times.append(time.perf_counter() - start)
        dist.barrier()

    rounds = max(1, args.rounds)
    per_round = max(1, args.steps // rounds)
    sync_times, nosync_times = [], []
    nosync = args.ranks > 1 and args.nosync
    phase(True, args.warmup_steps, None)
    if nosync:
        phase(False, args.warmup_steps, None)
    for _ in range(rounds):
        phase(True, per_round, sync_times)
        if nosync:
            phase(False, per_round, nosync_times)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    pss_mib = pss_now_mib()
    # What this rank holds between steps (before the breakdown loop, which adds nothing
    # to it but would blur the point in time).
    nbytes = lambda t: t.numel() * t.element_size()
    held = [sum(nbytes(p) for p in module.parameters()),
            sum(nbytes(p.grad) for p in module.parameters() if p.grad is not None),
            sum(nbytes(v) for state in local_optimizer.state.values() for k, v in state.items()
                if torch.is_tensor(v) and k != "step")]

    forward, backward, update = [], [], []
    breakdown_warmup = min(2, args.breakdown_steps)
    for i in range(breakdown_warmup + args.breakdown_steps):
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_of(module(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        if i >= breakdown_warmup:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
            update.append(t3 - t2)

    def median(v):
        return statistics.median(v) if v else 0.0

    mine = torch.tensor([median(sync_times), median(nosync_times), rss_mib, median(forward), median(backward),
                         median(update)] + held + [pss_mib], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(args.ranks)]
    dist.all_gather(gathered, mine)
    if rank == 0:
        col = lambda k, scale=1e3: [float(g[k]) * scale for g in gathered]
        grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        queue.put({
            "framework": "ddp_zero" if args.zero else ("torch_plain" if args.plain else "ddp"), "comm_hook": args.hook, "model": args.model, "ranks": args.ranks, "batch_per_rank": args.batch_per_rank,
            "threads": torch.get_num_threads(), "optimizer": args.optimizer,
            "parameters": sum(p.numel() for p in module.parameters() if p.requires_grad),
            "gradient_bytes": grad_bytes,
            "parameter_bytes": [p.numel() * p.element_size() for p in module.parameters()], "bucket_bytes": int(args.bucket_mb * (1 << 20)),
            "torch_version": torch.__version__, "bind": args.bind, "process_settings": args.process_settings,
            "step_ms": [t * 1e3 for t in sync_times],
            "step_ms_median_per_rank": col(0), "nosync_step_ms_median_per_rank": col(1),
            "max_rss_mib_per_rank": col(2, 1.0),
            "pss_mib_per_rank": col(9, 1.0),
            "forward_ms_median_per_rank": col(3), "backward_ms_median_per_rank": col(4),
            "optimizer_ms_median_per_rank": col(5),
            # Rank 0's bytes after the timed steps, then every rank's.
            "bytes_parameters": held[0], "bytes_gradients": held[1], "bytes_optimizer_state": held[2],
            "bytes_parameters_per_rank": [int(g[6]) for g in gathered],
            "bytes_gradients_per_rank": [int(g[7]) for g in gathered],
            "bytes_optimizer_state_per_rank": [int(g[8]) for g in gathered],
        })
    dist.barrier()
    # Skip the process group's teardown: ProcessGroupGloo's destructor can deadlock
    # at exit in torch 1.13 (seen here with the wide MLP), and nothing is left to do.
    sys.stdout.flush()
    os._exit(0)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrintQueue:
    """Rank 0's result, printed, when the ranks were started elsewhere (--rank)."""

    def put(self, result):
        print(json.dumps(result))


def main(argv=None):
    args = parse_args(argv)
    if args.plain and (args.ranks != 1 or args.zero):
        sys.exit("ddp_benchmark: --plain is PyTorch's loop on 1 rank, without DDP or ZeRO (--ranks 1)")
    if args.rank is not None:
        if args.init_method is None or not 0 <= args.rank < args.ranks:
            sys.exit("ddp_benchmark: --rank needs --init-method tcp://HOST:PORT and 0 <= rank < --ranks")
        process_settings(args)
        worker(args.rank, args, None, PrintQueue())
        return 0
    process_settings(args)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(args, free_port(), queue), nprocs=args.ranks, join=True, start_method="spawn")
    print(json.dumps(queue.get()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
