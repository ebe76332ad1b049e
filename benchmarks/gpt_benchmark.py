#!/usr/bin/python3
"""The language-model benchmark: the GPT of configs/kjv_gpt.textproto (4 layers, 4
heads, width 128, 64 bytes of context, 834,304 parameters) with Adam, trained on
random bytes by Lockstep (build/benchmarks/scaleout_benchmark --model=gpt under
launch/mpirun.sh) and by PyTorch (benchmarks/ddp_benchmark.py --model gpt: its
plain loop at 1 rank, DDP over gloo at 2), at 1 and 2 ranks, in the same run.

    benchmarks/gpt.sh [--batch-per-rank 32] [--steps 20] [--rounds 3] [--out DIR]

Per framework and rank count it reports the median step time of the slowest
rank, tokens per second (all ranks, and per rank), MFU (training FLOPs per token
as PaLM counts them, times tokens per second, over the float32 matrix-product
peak that scaleout_benchmark measures on every rank at once after its timed
steps; both frameworks are divided by the same peak), peak RSS of the largest
rank, and Lockstep's step time over PyTorch's at the same rank count (the median
over rounds of the ratio within a round; each round visits every run once, in
reverse order in odd rounds). A benchmark, not a test: nothing passes or fails
on a time. Output: the table on stdout and OUT/results.json (default
BUILD_DIR/gpt_benchmark).
"""
import argparse
import json
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import scaleout  # noqa: E402  (its launch, JSON and table helpers)

RUNS = [("lockstep", 1), ("torch_plain", 1), ("lockstep", 2), ("ddp", 2)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", default=os.environ.get("BUILD_DIR", os.path.join(ROOT, "build")))
    p.add_argument("--out", default=None)
    p.add_argument("--batch-per-rank", type=int, default=32)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank, both frameworks")
    p.add_argument("--python", default="/usr/bin/python3")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true", help="2 steps, 1 round, batch 4: checks that it runs")
    return p.parse_args(argv)


def log(msg):
    print(f"[gpt_benchmark] {msg}", file=sys.stderr, flush=True)


def command(framework, ranks, args, binary):
    common_steps = [str(args.warmup_steps), str(args.steps)]
    if framework == "lockstep":
        return [os.path.join(ROOT, "launch", "mpirun.sh"), "-n", str(ranks), "--", binary, "--mode=train",
                "--model=gpt", f"--batch_per_rank={args.batch_per_rank}", "--optimizer=adam",
                f"--threads={args.threads}", f"--warmup_steps={common_steps[0]}", f"--steps={common_steps[1]}",
                "--rounds=1", "--breakdown_steps=0", "--nosync_phase=false"]
    cmd = [args.python, os.path.join(HERE, "ddp_benchmark.py"), "--ranks", str(ranks), "--model", "gpt",
           "--batch-per-rank", str(args.batch_per_rank), "--optimizer", "adam", "--threads", str(args.threads),
           "--warmup-steps", common_steps[0], "--steps", common_steps[1], "--rounds", "1", "--breakdown-steps", "0",
           "--no-nosync", "--process-settings", "lockstep"]
    return cmd + (["--plain"] if framework == "torch_plain" else [])


def main(argv=None):
    args = parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.batch_per_rank, args.warmup_steps = 2, 1, 4, 1
    started = time.monotonic()
    binary = os.path.join(args.build_dir, "benchmarks", "scaleout_benchmark")
    if not os.access(binary, os.X_OK):
        sys.exit(f"gpt_benchmark: {binary} not found; build it: cmake --build {args.build_dir} "
                 "--target scaleout_benchmark")
    out_dir = args.out or os.path.join(args.build_dir, "gpt_benchmark")
    os.makedirs(out_dir, exist_ok=True)
    runs = list(RUNS)
    torch_version, why = scaleout.ddp_available(args.python)
    if why:
        log(f"PyTorch is not available through {args.python} ({why}); Lockstep only")
        runs = [r for r in runs if r[0] == "lockstep"]
    errors, raw = [], {}
    for rnd in range(args.rounds):
        for framework, ranks in (runs if rnd % 2 == 0 else list(reversed(runs))):
            log(f"round {rnd + 1}/{args.rounds}: {framework} on {ranks} rank(s)")
            result, err = scaleout.run(command(framework, ranks, args, binary), args.timeout)
            if err:
                errors.append(err)
                log(err)
                continue
            result["round"] = rnd
            raw.setdefault((framework, ranks), []).append(result)

    def step_ms(r):
        return max(r["step_ms_median_per_rank"])

    peaks = {n: scaleout.median(r["peak_flops_per_rank"][0] for r in raw.get(("lockstep", n), [])) for n in (1, 2)}
    flops_per_token = next((r["flops_per_token"] for (fw, _), rs in raw.items() if fw == "lockstep" for r in rs), None)
    table = []
    for (framework, ranks), rs in sorted(raw.items(), key=lambda kv: (kv[0][1], kv[0][0] != "lockstep")):
        ms = scaleout.median(step_ms(r) for r in rs)
        tokens = ranks * args.batch_per_rank * 64 / (ms / 1e3) if ms else None
        peak = peaks.get(ranks)
        entry = {"framework": framework, "ranks": ranks, "runs": len(rs), "step_ms": ms,
                 "step_ms_per_round": {r["round"]: step_ms(r) for r in rs},
                 "tokens_per_second": tokens, "tokens_per_second_per_rank": tokens / ranks if tokens else None,
                 "mfu": flops_per_token * tokens / (peak * ranks) if tokens and peak and flops_per_token else None,
                 "peak_rss_mib": max(max(r["max_rss_mib_per_rank"]) for r in rs),
                 "parameters": rs[-1]["parameters"]}
        table.append(entry)
    by_key = {(e["framework"], e["ranks"]): e for e in table}
    for ranks, theirs in ((1, "torch_plain"), (2, "ddp")):
        ours, base = by_key.get(("lockstep", ranks)), by_key.get((theirs, ranks))
        if ours and base:
            ratios = [t / base["step_ms_per_round"][k] for k, t in ours["step_ms_per_round"].items()
                      if base["step_ms_per_round"].get(k)]
            ours["step_time_over_torch"] = scaleout.median(ratios)
            ours["torch_baseline"] = theirs
    params = {e["parameters"] for e in table}
    if len(params) > 1:
        errors.append(f"the frameworks' models differ: {sorted(params)} parameters")
    results = {"command": shlex.join([os.path.relpath(sys.argv[0], ROOT)] + (argv if argv is not None else sys.argv[1:])),
               "machine": {"cores": os.cpu_count(), "python_torch": torch_version,
                           "date": time.strftime("%Y-%m-%d %H:%M:%S")},
               "settings": {"batch_per_rank": args.batch_per_rank, "steps": args.steps, "rounds": args.rounds,
                            "threads": args.threads, "sequence_length": 64},
               "flops_per_token": flops_per_token, "peak_flops_per_rank": peaks, "runs": table, "errors": errors,
               "seconds": time.monotonic() - started}
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"GPT benchmark: {next(iter(params), 0):,} parameters, Adam, {args.batch_per_rank} windows of 64 bytes per "
          f"rank, {args.steps} timed steps x {args.rounds} round(s); peak {scaleout.fmt((peaks.get(1) or 0) / 1e9, '.0f')}"
          f" GFLOP/s per rank at 1 rank, {scaleout.fmt((peaks.get(2) or 0) / 1e9, '.0f')} at 2")
    rows = [[e["ranks"], {"lockstep": "Lockstep", "torch_plain": "PyTorch plain loop", "ddp": "PyTorch DDP"}[e["framework"]],
             scaleout.fmt(e["step_ms"], ".1f"), scaleout.fmt(e["tokens_per_second"], ".0f"),
             scaleout.fmt(e["tokens_per_second_per_rank"], ".0f"), scaleout.fmt(e["mfu"], ".3f"),
             scaleout.fmt(e["peak_rss_mib"], ".0f"), scaleout.fmt(e.get("step_time_over_torch"))] for e in table]
    scaleout.print_table("Per framework", ["ranks", "framework", "step ms", "tokens/s", "tokens/s/rank", "MFU",
                                           "peak RSS MiB", "ours/torch"], rows)
    print(f"\n{results['seconds']:.0f} s in all; results: {os.path.join(out_dir, 'results.json')}")
    for e in errors:
        log(f"error: {e}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
