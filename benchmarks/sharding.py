#!/usr/bin/python3
"""Lockstep's sharding benchmark: what each partitioning strategy saves in memory
and costs in step time, against replicated data parallelism at the same rank
count, and against PyTorch's ZeroRedundancyOptimizer at 2 ranks.

    benchmarks/sharding.sh [--quick] [--out DIR] [--ranks 1,2,4] [--strategies replicated,sharded_gradients]

For one model (default: the wide MLP 1024-4096-4096-1024, 25.2M parameters) with
Adam, at each rank count (default 1, 2 and 4, oversubscribed past the cores) and
for each strategy, it runs build/benchmarks/scaleout_benchmark --mode=train
--partitioning=STRATEGY under launch/mpirun.sh (same per-rank batch at every
rank count) and reports, per rank: the bytes of parameters, gradients and
optimizer state it holds between steps, each as a ratio to replicated at the same
rank count; peak RSS and PSS at rest (after malloc_trim); the median step time and its ratio to replicated. At 2 ranks
it also runs the same model under PyTorch DDP with ZeroRedundancyOptimizer(Adam)
over gloo (benchmarks/ddp_benchmark.py --zero) and gives the ratio of each of our
step times to it. All of it in the same run, in rounds that visit every
(strategy, ranks) once, in one order in even rounds and the reverse in odd ones,
so that a drift of the machine's load weighs on every strategy alike; step-time
ratios are taken within a round, then the median over rounds.

The strategies: --strategies, default replicated, sharded_optimizer_state and
sharded_gradients, and fully_sharded when the benchmark binary accepts that name
(lockstep::ParsePartitioningStrategy decides: one tiny run asks it). The byte
counts under "replicated" (and at 1 rank, where nothing is sharded) are counted
from the model's parameters, their gradients and the optimizer's state, as
ShardedDataParallel::bytes() counts its own. Bytes are the largest over ranks
(the memory a job needs is its largest rank's); every rank's are in the JSON.

A benchmark, not a test: nothing here passes or fails on a time. --quick (the
small MLP, a few steps, one round, 1 and 2 ranks) only checks that everything
runs. Output: the
tables on stdout and OUT/results.json (default BUILD_DIR/sharding).
"""
import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import scaleout  # noqa: E402  (its launch, JSON and table helpers)

DEFAULT_STRATEGIES = ["replicated", "sharded_optimizer_state", "sharded_gradients"]
MAYBE_STRATEGIES = ["fully_sharded"]  # added when the binary accepts the name
TORCH_ZERO = "torch_zero"  # PyTorch DDP + ZeroRedundancyOptimizer, at 2 ranks
# Per-rank batch, warm-up steps and timed steps of one run; rounds of the suite.
FULL = dict(model="wide_mlp", batch=32, warmup=2, steps=8, rounds=3, ranks="1,2,4")
QUICK = dict(model="small_mlp", batch=8, warmup=1, steps=2, rounds=1, ranks="1,2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="the small MLP, a few steps, one round, 1 and 2 ranks: checks that it runs")
    p.add_argument("--out", default=None, help="output directory (default: BUILD_DIR/sharding)")
    p.add_argument("--build-dir", default=os.environ.get("BUILD_DIR", os.path.join(ROOT, "build")))
    p.add_argument("--model", default=None, choices=scaleout.MODELS, help="default wide_mlp (quick: small_mlp)")
    p.add_argument("--ranks", default=None, help="rank counts (default 1,2,4; quick 1,2)")
    p.add_argument("--strategies", default=None,
                   help="comma-separated partitioning strategies (default: replicated, sharded_optimizer_state, "
                        "sharded_gradients, and fully_sharded when the library has it); replicated is always added, "
                        "as the baseline of the ratios")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    p.add_argument("--batch-per-rank", type=int, default=None)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per run")
    p.add_argument("--rounds", type=int, default=None, help="interleaved repetitions of every run")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank, both frameworks")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch's ZeroRedundancyOptimizer")
    p.add_argument("--python", default="/usr/bin/python3", help="the Python with PyTorch")
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    return p.parse_args(argv)


def log(msg):
    print(f"[sharding] {msg}", file=sys.stderr, flush=True)


def lockstep_cmd(binary, strategy, ranks, cfg, args):
    return [os.path.join(ROOT, "launch", "mpirun.sh"), "-n", str(ranks), "--", binary, "--mode=train",
            f"--model={cfg['model']}", f"--partitioning={strategy}", f"--batch_per_rank={cfg['batch']}",
            f"--optimizer={args.optimizer}", f"--threads={args.threads}", f"--warmup_steps={cfg['warmup']}",
            f"--steps={cfg['steps']}", "--rounds=1", "--breakdown_steps=0", "--nosync_phase=false"]


def torch_zero_cmd(ranks, cfg, args):
    return [args.python, os.path.join(HERE, "ddp_benchmark.py"), "--zero", "--no-nosync", "--ranks", str(ranks),
            "--model", cfg["model"], "--batch-per-rank", str(cfg["batch"]), "--optimizer", args.optimizer,
            "--threads", str(args.threads), "--warmup-steps", str(cfg["warmup"]), "--steps", str(cfg["steps"]),
            "--rounds", "1", "--breakdown-steps", "0"]


def probe(binary, strategy):
    """None when the binary takes --partitioning=strategy (its ParsePartitioningStrategy
    knows the name: a one-step run of the small MLP on one rank), else why not."""
    cmd = [os.path.join(ROOT, "launch", "mpirun.sh"), "-n", "1", "--", binary, "--mode=train", "--model=small_mlp",
           f"--partitioning={strategy}", "--batch_per_rank=2", "--warmup_steps=0", "--steps=1", "--rounds=1",
           "--breakdown_steps=0"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "timed out"
    if proc.returncode == 0:
        return None
    return next((line for line in proc.stderr.splitlines() if "scaleout_benchmark:" in line),
                f"exit {proc.returncode}")


def step_ms(result):
    """A run's step time: its slowest rank's median (a synchronous job goes at that pace)."""
    return max(result["step_ms_median_per_rank"])


def summarize(runs):
    """Medians over the runs of one (strategy, ranks); bytes and RSS: the largest rank's."""
    return {
        "runs": len(runs),
        "step_ms": scaleout.median(step_ms(r) for r in runs),
        "step_ms_per_round": {r["round"]: step_ms(r) for r in runs},
        "comm_wait_ms": scaleout.median(max(r["comm_wait_ms_median_per_rank"]) for r in runs
                                        if r.get("comm_wait_ms_median_per_rank")),
        "max_rss_mib": max(max(r["max_rss_mib_per_rank"]) for r in runs),
        "max_rss_mib_per_rank": [max(v) for v in zip(*(r["max_rss_mib_per_rank"] for r in runs))],
        "pss_mib": scaleout.median(max(r["pss_mib_per_rank"]) for r in runs if r.get("pss_mib_per_rank")),
        "bytes_parameters": max(runs[-1]["bytes_parameters_per_rank"]),
        "bytes_gradients": max(runs[-1]["bytes_gradients_per_rank"]),
        "bytes_optimizer_state": max(runs[-1]["bytes_optimizer_state_per_rank"]),
        "bytes_parameters_per_rank": runs[-1]["bytes_parameters_per_rank"],
        "bytes_gradients_per_rank": runs[-1]["bytes_gradients_per_rank"],
        "bytes_optimizer_state_per_rank": runs[-1]["bytes_optimizer_state_per_rank"],
        "sharded": bool(runs[-1].get("sharded", 0)),
        "parameters": runs[-1]["parameters"],
        "wall_s": sum(r["wall_s"] for r in runs),
    }


def round_ratio(entry, base):
    """Median over rounds of entry's step time over base's in the same round."""
    ratios = [t / base["step_ms_per_round"][rnd] for rnd, t in entry["step_ms_per_round"].items()
              if base["step_ms_per_round"].get(rnd)]
    return scaleout.median(ratios) if ratios else None


def ratio(a, b):
    return a / b if b else None


def main(argv=None):
    args = parse_args(argv)
    started = time.monotonic()
    base = QUICK if args.quick else FULL
    cfg = {"model": args.model or base["model"],
           "batch": args.batch_per_rank or base["batch"],
           "warmup": base["warmup"] if args.warmup_steps is None else args.warmup_steps,
           "steps": args.steps or base["steps"]}
    rounds = args.rounds or base["rounds"]
    rank_counts = sorted({int(x) for x in (args.ranks or base["ranks"]).split(",") if x})
    out_dir = args.out or os.path.join(args.build_dir, "sharding")
    os.makedirs(out_dir, exist_ok=True)
    binary = os.path.join(args.build_dir, "benchmarks", "scaleout_benchmark")
    if not os.access(binary, os.X_OK):
        sys.exit(f"sharding: {binary} not found; build it: cmake --build {args.build_dir} --target scaleout_benchmark")
    errors = []

    if args.strategies:
        strategies = [s for s in args.strategies.split(",") if s]
    else:
        strategies = list(DEFAULT_STRATEGIES)
        for s in MAYBE_STRATEGIES:
            why = probe(binary, s)
            if why is None:
                strategies.append(s)
            else:
                log(f"{s} left out: {why}")
    if "replicated" not in strategies:
        strategies.insert(0, "replicated")  # the baseline of every ratio
    if args.strategies:
        for s in strategies:
            why = probe(binary, s) if s != "replicated" else None
            if why is not None:
                sys.exit(f"sharding: --partitioning={s} does not run: {why}")

    torch_version = None
    if not args.no_torch and 2 in rank_counts:
        torch_version, why = scaleout.ddp_available(args.python)
        if why:
            log(f"PyTorch is not available through {args.python} ({why}); Lockstep only")

    # Rounds: every (strategy, ranks) once, and PyTorch's ZeRO at 2 ranks; the order
    # reversed in odd rounds (ABBA).
    sequence = [(s, n) for n in rank_counts for s in strategies]
    if torch_version:
        sequence.append((TORCH_ZERO, 2))
    raw = {}
    for rnd in range(rounds):
        order = sequence if rnd % 2 == 0 else list(reversed(sequence))
        for strategy, ranks in order:
            cmd = (torch_zero_cmd(ranks, cfg, args) if strategy == TORCH_ZERO
                   else lockstep_cmd(binary, strategy, ranks, cfg, args))
            log(f"round {rnd + 1}/{rounds}: {strategy} on {ranks} rank(s)")
            result, err = scaleout.run(cmd, args.timeout)
            if err:
                errors.append(err)
                log(err)
                continue
            result["round"] = rnd
            raw.setdefault(str(ranks), {}).setdefault(strategy, []).append(result)

    # Summaries; ratios to replicated at the same rank count, and to PyTorch's ZeRO.
    table = {}
    for ranks, by_strategy in raw.items():
        entries = {s: summarize(runs) for s, runs in by_strategy.items()}
        rep = entries.get("replicated")
        zero = entries.get(TORCH_ZERO)
        for s, e in entries.items():
            if rep:
                for k in ("parameters", "gradients", "optimizer_state"):
                    e[f"bytes_{k}_ratio"] = ratio(e[f"bytes_{k}"], rep[f"bytes_{k}"])
                e["max_rss_ratio"] = ratio(e["max_rss_mib"], rep["max_rss_mib"])
                e["pss_ratio"] = ratio(e["pss_mib"], rep["pss_mib"]) if e["pss_mib"] and rep["pss_mib"] else None
                e["step_time_ratio"] = round_ratio(e, rep)
            if zero and s != TORCH_ZERO:
                e["step_time_ratio_over_torch_zero"] = round_ratio(e, zero)
        table[ranks] = entries
    for ranks, entries in table.items():
        first = next(iter(entries.values()))
        for s, e in entries.items():
            if e["parameters"] != first["parameters"]:
                errors.append(f"{ranks} ranks: {s} has {e['parameters']} parameters, not {first['parameters']}")

    results = {
        "command": shlex.join([os.path.relpath(sys.argv[0], ROOT)] + (argv if argv is not None else sys.argv[1:])),
        "machine": {"hostname": platform.node(), "cores": os.cpu_count(), "python_torch": torch_version,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S")},
        "settings": {"quick": args.quick, "model": cfg["model"], "title": scaleout.MODEL_TITLES[cfg["model"]],
                     "optimizer": args.optimizer, "batch_per_rank": cfg["batch"], "warmup_steps": cfg["warmup"],
                     "steps": cfg["steps"], "rounds": rounds, "rank_counts": rank_counts, "strategies": strategies,
                     "threads_per_rank": args.threads},
        "ranks": table,
        "errors": errors,
        "seconds": time.monotonic() - started,
    }
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print_report(results)
    print(f"\nresults: {os.path.join(out_dir, 'results.json')}")
    for e in errors:
        log(f"error: {e}")
    return 1 if errors else 0


def mib(nbytes):
    return scaleout.fmt(nbytes / (1 << 20) if nbytes is not None else None, ".1f")


def print_report(results):
    s = results["settings"]
    params = next((e["parameters"] for entries in results["ranks"].values() for e in entries.values()), 0)
    print(f"Sharding benchmark: {s['title']} ({params:,} parameters), {s['optimizer']}, per-rank batch "
          f"{s['batch_per_rank']}, {s['steps']} timed steps per run, {s['rounds']} round(s), "
          f"{results['machine']['cores']} cores. Bytes each rank holds between steps (largest rank), x = ratio to "
          f"replicated at the same rank count; step time: slowest rank's median, ratios within a round, median")
    rows = []
    for ranks in sorted(results["ranks"], key=int):
        entries = results["ranks"][ranks]
        for name in s["strategies"] + [TORCH_ZERO]:
            e = entries.get(name)
            if e is None:
                continue
            label = "torch DDP+ZeroRedundancyOptimizer" if name == TORCH_ZERO else name
            rows.append([ranks, label,
                         mib(e["bytes_parameters"]), scaleout.fmt(e.get("bytes_parameters_ratio")),
                         mib(e["bytes_gradients"]), scaleout.fmt(e.get("bytes_gradients_ratio")),
                         mib(e["bytes_optimizer_state"]), scaleout.fmt(e.get("bytes_optimizer_state_ratio")),
                         scaleout.fmt(e["max_rss_mib"], ".0f"), scaleout.fmt(e.get("max_rss_ratio")),
                         scaleout.fmt(e.get("pss_mib"), ".0f"), scaleout.fmt(e.get("pss_ratio")),
                         scaleout.fmt(e["step_ms"], ".1f"), scaleout.fmt(e.get("step_time_ratio")),
                         scaleout.fmt(e.get("step_time_ratio_over_torch_zero"))])
    scaleout.print_table("Per rank", ["ranks", "strategy", "params MiB", "x", "grads MiB", "x", "opt state MiB", "x",
                                      "peak RSS MiB", "x", "PSS MiB", "x", "step ms", "x", "ours/torch ZeRO"], rows)
    print(f"\n{results['seconds']:.0f} s in all")


if __name__ == "__main__":
    sys.exit(main())
