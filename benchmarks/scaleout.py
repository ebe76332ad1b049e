#!/usr/bin/python3
"""Lockstep's scale-out benchmark suite, side by side with PyTorch DDP.

    benchmarks/scaleout.sh [--quick] [--out DIR] [--hosts 4 --gpus-per-host 8 ...]

For the small MLP (784-256-256-10), the wide MLP (1024-4096-4096-1024) and the
Fashion-MNIST CNN, at 1, 2, 4, ... ranks (up to the cores here), with the same
per-rank batch at every rank count (weak scaling), it runs Lockstep's Trainer
under mpirun (build/benchmarks/scaleout_benchmark) and the same model, batch,
optimizer and threads under PyTorch DistributedDataParallel over gloo
(benchmarks/ddp_benchmark.py), interleaving the two over several rounds, and
reports per-step time (median), examples/s, scaling efficiency, the share of
step time spent on communication, peak memory, and the Lockstep/DDP ratio. It
also measures all-reduce bandwidth (Lockstep's communicator against raw
MPI_Allreduce), checks a cost model against the measured 2-rank step and
projects scaling efficiency on the cluster described by the flags. Output: a
table on stdout, OUT/results.json and SVG plots in OUT. See benchmarks/README.md.
"""
import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import svg_plot  # noqa: E402

MODELS = ["small_mlp", "wide_mlp", "cnn"]
MODEL_TITLES = {"small_mlp": "small MLP 784-256-256-10", "wide_mlp": "wide MLP 1024-4096-4096-1024",
                "cnn": "Fashion-MNIST CNN"}
# Per-rank batch, warm-up steps, timed steps per phase, sync/nosync alternations, breakdown steps.
FULL = {"small_mlp": dict(batch=32, warmup=10, steps=100, rounds=2, breakdown=20),
        "wide_mlp": dict(batch=32, warmup=2, steps=6, rounds=2, breakdown=2),
        "cnn": dict(batch=64, warmup=3, steps=20, rounds=2, breakdown=4)}
QUICK = {"small_mlp": dict(batch=32, warmup=2, steps=8, rounds=2, breakdown=4),
         "wide_mlp": dict(batch=8, warmup=1, steps=1, rounds=1, breakdown=1),
         "cnn": dict(batch=16, warmup=1, steps=4, rounds=2, breakdown=2)}
DDP_VARIANTS = {
    # PyTorch as it ships, with the thread settings both sides share.
    "pytorch": "ddp",
    # DDP also given the glibc malloc settings and denormal flushing that
    # Lockstep's ConfigureTorchForTraining makes: what is left is the framework.
    "lockstep-env": "ddp_lockstep_env",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few steps on small batches: checks that everything runs")
    p.add_argument("--out", default=None, help="output directory (default: BUILD_DIR/scaleout)")
    p.add_argument("--build-dir", default=os.environ.get("BUILD_DIR", os.path.join(ROOT, "build")))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--ranks", default=None, help="rank counts, e.g. 1,2,4 (default: 1 and powers of two up to the cores)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved repetitions of every run (default 5; quick 1)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank, both frameworks")
    p.add_argument("--ddp-variants", default=None,
                   help="comma-separated: pytorch (DDP as shipped), lockstep-env (DDP with Lockstep's malloc and "
                        "denormal settings); default: pytorch")
    p.add_argument("--python", default="/usr/bin/python3", help="the Python with PyTorch for DDP")
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    c = p.add_argument_group("cluster projection")
    c.add_argument("--hosts", type=int, default=4)
    c.add_argument("--gpus-per-host", type=int, default=8)
    c.add_argument("--nvlink-gbps", type=float, default=200.0, help="intra-host bus bandwidth per GPU, GB/s")
    c.add_argument("--network-gbps", type=float, default=50.0, help="network bandwidth per host, GB/s")
    c.add_argument("--nvlink-latency-us", type=float, default=5.0, help="alpha per ring step within a host")
    c.add_argument("--network-latency-us", type=float, default=15.0, help="alpha per ring step across hosts")
    c.add_argument("--compute-speedup", type=float, default=1.0,
                   help="how many times faster one cluster device runs a step than one rank here")
    c.add_argument("--project-only", metavar="RESULTS_JSON",
                   help="measure nothing: project the 1-rank results of an earlier run onto the cluster above")
    return p.parse_args(argv)


def log(msg):
    print(f"[scaleout] {msg}", file=sys.stderr, flush=True)


def last_json(text):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


def run(cmd, timeout, env=None):
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, **(env or {})))
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s: {shlex.join(cmd)}"
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return None, f"exit {proc.returncode}: {shlex.join(cmd)}: " + " | ".join(tail)
    try:
        result = last_json(proc.stdout)
    except ValueError as e:
        return None, f"{e}: {shlex.join(cmd)}"
    result["wall_s"] = time.monotonic() - start
    return result, None


def lockstep_cmd(args, binary, model, ranks, cfg):
    return [os.path.join(ROOT, "launch", "mpirun.sh"), "-n", str(ranks), "--", binary, "--mode=train",
            f"--model={model}", f"--batch_per_rank={cfg['batch']}", f"--optimizer={args.optimizer}",
            f"--threads={args.threads}", f"--warmup_steps={cfg['warmup']}", f"--steps={cfg['steps']}",
            f"--rounds={cfg['rounds']}", f"--breakdown_steps={cfg['breakdown']}"]


def ddp_cmd(args, model, ranks, cfg, variant):
    return [args.python, os.path.join(HERE, "ddp_benchmark.py"), "--ranks", str(ranks), "--model", model,
            "--batch-per-rank", str(cfg["batch"]), "--optimizer", args.optimizer, "--threads", str(args.threads),
            "--warmup-steps", str(cfg["warmup"]), "--steps", str(cfg["steps"]), "--rounds", str(cfg["rounds"]),
            "--breakdown-steps", str(cfg["breakdown"]), "--process-settings",
            "lockstep" if variant == "lockstep-env" else "pytorch"]


def ddp_available(python):
    try:
        proc = subprocess.run([python, "-c", "import torch, torch.distributed as d; assert d.is_gloo_available(); "
                               "print(torch.__version__)"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)
    if proc.returncode != 0:
        return None, (proc.stderr.strip().splitlines() or ["import failed"])[-1]
    return proc.stdout.strip(), None


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs):
    """Combines the runs of one (framework, model, ranks): medians over runs of the
    slowest rank's median (a synchronous job goes at its slowest rank's pace)."""
    if not runs:
        return None
    pick = lambda key: median(max(r[key]) for r in runs if r.get(key))
    out = {
        "runs": len(runs),
        "step_ms": pick("step_ms_median_per_rank"),
        "step_ms_per_run": [max(r["step_ms_median_per_rank"]) for r in runs],
        "nosync_step_ms": pick("nosync_step_ms_median_per_rank") if runs[0]["ranks"] > 1 else None,
        "max_rss_mib": max(max(r["max_rss_mib_per_rank"]) for r in runs),
        "max_rss_mib_per_rank": [max(v) for v in zip(*(r["max_rss_mib_per_rank"] for r in runs))],
        "forward_ms": pick("forward_ms_median_per_rank"),
        "backward_ms": pick("backward_ms_median_per_rank"),
        "optimizer_ms": pick("optimizer_ms_median_per_rank"),
        "wall_s": sum(r["wall_s"] for r in runs),
    }
    if "comm_wait_ms_median_per_rank" in runs[0]:
        out["comm_wait_ms"] = pick("comm_wait_ms_median_per_rank")
        out["bucket_wait_ms"] = pick("bucket_wait_ms_median_per_rank")
    return out


def round_step_ms(runs, rnd):
    """The step time (slowest rank's median) of the run of round rnd, if any."""
    for r in runs:
        if r.get("round") == rnd:
            return max(r["step_ms_median_per_rank"])
    return None


def add_derived(entry, ranks, batch, one_rank):
    step = entry["step_ms"]
    entry["examples_per_s"] = ranks * batch / (step / 1e3)
    entry["efficiency"] = (entry["examples_per_s"] / (ranks * one_rank["examples_per_s"])) if one_rank else None
    if ranks > 1 and entry.get("nosync_step_ms") is not None:
        entry["comm_share"] = max(0.0, step - entry["nosync_step_ms"]) / step
    else:
        entry["comm_share"] = 0.0
    if entry.get("comm_wait_ms") is not None:
        entry["comm_wait_share"] = entry["comm_wait_ms"] / step


# --- the cost model (benchmarks/README.md) ---------------------------------------

def ring_allreduce_s(nbytes, n, alpha_s, bus_Bps):
    """Ring all-reduce of nbytes over n ranks: 2(n-1) steps of latency alpha and
    2(n-1)/n of the message over each rank's link."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * nbytes / bus_Bps


def cluster_allreduce_s(nbytes, ranks, c):
    """Two levels: a ring within each host (reduce-scatter + all-gather over NVLink)
    around an all-reduce across hosts of each GPU's 1/g share, the g shares sharing
    the host's network: (S/g) / (B_net/g) = S / B_net per ring step."""
    g = min(ranks, c["gpus_per_host"])
    h = max(1, math.ceil(ranks / c["gpus_per_host"]))
    intra = ring_allreduce_s(nbytes, g, c["nvlink_latency_s"], c["nvlink_Bps"])
    inter = ring_allreduce_s(nbytes, h, c["network_latency_s"], c["network_Bps"])
    return intra + inter


def buckets_of(parameter_bytes, bucket_bytes):
    """Lockstep's bucketing: parameters in reverse registration order (the order
    backward finishes them), packed into buckets of at most bucket_bytes."""
    buckets, current = [], 0
    for b in reversed(parameter_bytes):
        if current > 0 and current + b > bucket_bytes:
            buckets.append(current)
            current = 0
        current += b
    if current:
        buckets.append(current)
    return buckets


def predict_step_s(parts, buckets, allreduce_s, small_collectives=1, small_bytes=8):
    """parts: forward, backward, optimizer, other (seconds). Backward makes the
    gradient bytes at a uniform rate; bucket k starts when its last gradient is
    final and the previous bucket is done. Only communication that outlasts
    backward is exposed."""
    total = sum(buckets) or 1
    ready, end, done = 0.0, 0.0, 0
    for size in buckets:
        done += size
        ready = parts["backward"] * done / total
        end = max(ready, end) + allreduce_s(size)
    exposed = max(0.0, end - parts["backward"])
    latency = small_collectives * allreduce_s(small_bytes) if buckets else 0.0
    step = parts["forward"] + parts["backward"] + parts["optimizer"] + parts["other"] + exposed + latency
    return step, exposed + latency


def fit_allreduce(rows, n):
    """alpha from the smallest message; bus bandwidth by least squares over the
    messages of 64 KiB and more: t - 2(n-1)alpha = (2(n-1)/n) S / B."""
    rows = sorted(rows, key=lambda r: r["bytes"])
    alpha = rows[0]["lockstep_s"] / (2 * (n - 1))
    big = [r for r in rows if r["bytes"] >= 65536] or rows
    xs = [2 * (n - 1) / n * r["bytes"] for r in big]
    ys = [max(1e-9, r["lockstep_s"] - 2 * (n - 1) * alpha) for r in big]
    inv_b = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return alpha, 1.0 / inv_b


def measured_allreduce_s(rows):
    """T(S) from the measured all-reduce times: log-log interpolation between the
    measured sizes, proportional to S beyond the largest."""
    pts = sorted((r["bytes"], r["lockstep_s"]) for r in rows)

    def t(nbytes):
        if nbytes <= pts[0][0]:
            return pts[0][1]
        for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
            if nbytes <= s1:
                w = math.log(nbytes / s0) / math.log(s1 / s0)
                return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
        return pts[-1][1] * nbytes / pts[-1][0]
    return t


def compute_parts(entry, step_s):
    """Forward / backward / optimizer from the breakdown loop, scaled to the
    measured compute of the step; 'other' is the rest (Trainer bookkeeping)."""
    f, b, o = entry["forward_ms"] / 1e3, entry["backward_ms"] / 1e3, entry["optimizer_ms"] / 1e3
    measured = f + b + o
    scale = min(1.0, step_s / measured) if measured > 0 else 1.0
    parts = {"forward": f * scale, "backward": b * scale, "optimizer": o * scale}
    parts["other"] = max(0.0, step_s - sum(parts.values()))
    return parts


def project(results, args):
    """The cost model on the cluster that the flags describe, from the 1-rank
    measurements in results."""
    cluster = {"hosts": args.hosts, "gpus_per_host": args.gpus_per_host, "nvlink_gbps": args.nvlink_gbps,
               "network_gbps": args.network_gbps, "nvlink_latency_us": args.nvlink_latency_us,
               "network_latency_us": args.network_latency_us, "compute_speedup": args.compute_speedup}
    c = {"gpus_per_host": args.gpus_per_host, "nvlink_Bps": args.nvlink_gbps * 1e9,
         "network_Bps": args.network_gbps * 1e9, "nvlink_latency_s": args.nvlink_latency_us * 1e-6,
         "network_latency_s": args.network_latency_us * 1e-6}
    projection = {"cluster": cluster, "models": {}}
    proj_ranks = sorted({2 ** k for k in range(0, 16) if 2 ** k <= args.gpus_per_host} |
                        {args.gpus_per_host * h for h in range(1, args.hosts + 1) if h & (h - 1) == 0 or h == args.hosts})
    for model, m in results["models"].items():
        ls = m.get("lockstep", {})
        if "1" not in ls or not m.get("parameter_bytes"):
            continue
        t1 = ls["1"]["step_ms"] / 1e3 / args.compute_speedup
        parts = compute_parts(ls["1"], ls["1"]["step_ms"] / 1e3)
        parts = {k: v / args.compute_speedup for k, v in parts.items()}
        buckets = buckets_of(m["parameter_bytes"], m["bucket_bytes"])
        curve = []
        for n in proj_ranks:
            step, comm = predict_step_s(parts, buckets, lambda s, n=n: cluster_allreduce_s(s, n, c)) if n > 1 \
                else (t1, 0.0)
            curve.append({"ranks": n, "hosts": max(1, math.ceil(n / args.gpus_per_host)), "step_ms": step * 1e3,
                          "comm_ms": comm * 1e3, "efficiency": t1 / step,
                          "examples_per_s": n * m["batch_per_rank"] / step})
        projection["models"][model] = curve
    return projection


# --- output --------------------------------------------------------------------

def fmt(v, spec=".2f", none="-"):
    return none if v is None else format(v, spec)


def print_table(title, header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"\n{title}")
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


def main(argv=None):
    args = parse_args(argv)
    if args.project_only:
        with open(args.project_only) as f:
            results = json.load(f)
        results["projection"] = project(results, args)
        print_projection(results["projection"])
        return 0
    started = time.monotonic()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if args.ranks:
        rank_counts = sorted({int(x) for x in args.ranks.split(",")})
    else:
        rank_counts = [1] + [2 ** k for k in range(1, 8) if 2 ** k <= max(2, cores)]
    if 1 not in rank_counts:
        rank_counts.insert(0, 1)  # the baseline of the efficiency
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            sys.exit(f"scaleout: unknown model '{m}' (known: {', '.join(MODELS)})")
    configs = QUICK if args.quick else FULL
    rounds = args.rounds or (1 if args.quick else 5)
    variants = (args.ddp_variants or "pytorch").split(",")
    for v in variants:
        if v not in DDP_VARIANTS:
            sys.exit(f"scaleout: unknown DDP variant '{v}' (known: {', '.join(DDP_VARIANTS)})")
    out_dir = args.out or os.path.join(args.build_dir, "scaleout")
    os.makedirs(out_dir, exist_ok=True)
    binary = os.path.join(args.build_dir, "benchmarks", "scaleout_benchmark")
    if not os.access(binary, os.X_OK):
        sys.exit(f"scaleout: {binary} not found; build it: cmake --build {args.build_dir} --target scaleout_benchmark")
    torch_version, why_no_ddp = ddp_available(args.python)
    if why_no_ddp:
        log(f"PyTorch DDP is not available through {args.python} ({why_no_ddp}); Lockstep only")
        variants = []
    errors = []

    # 1. All-reduce bandwidth: Lockstep's communicator against raw MPI_Allreduce.
    collectives = {}
    sizes = [8, 4096, 65536, 262144, 1 << 20] + ([] if args.quick else [4 << 20, 16 << 20, 64 << 20])
    for n in [r for r in rank_counts if r > 1]:
        log(f"all-reduce bandwidth on {n} ranks")
        result, err = run([os.path.join(ROOT, "launch", "mpirun.sh"), "-n", str(n), "--", binary, "--mode=collectives",
                           "--sizes=" + ",".join(map(str, sizes))], args.timeout)
        if err:
            errors.append(err)
            continue
        rows = []
        for r in result["allreduce"]:
            # lockstep_s: a gradient bucket's buffer (AllocateCollectiveBuffer: shared memory on
            # one host); lockstep_plain_s: an ordinary tensor (through MPI).
            # gloo_s: the Gloo communicator (libtorch's c10d, loopback TCP), when built.
            row = {"bytes": r["bytes"], "lockstep_s": r["lockstep_s"], "mpi_s": r["mpi_s"],
                   "lockstep_plain_s": r.get("lockstep_plain_s"), "gloo_s": r.get("gloo_s")}
            for who in ("lockstep", "lockstep_plain", "mpi", "gloo"):
                if row[f"{who}_s"] is None:
                    continue
                algbw = r["bytes"] / r[f"{who}_s"] / 1e9
                row[f"{who}_algbw_gbps"] = algbw
                row[f"{who}_busbw_gbps"] = algbw * 2 * (n - 1) / n
            rows.append(row)
        collectives[str(n)] = rows

    # 2. Training runs. Every round visits every model; within a model the
    # (framework, ranks) runs go in one order in even rounds and in the reverse
    # order in odd ones (ABBA), so that a slow drift of the machine's load (a build
    # next door) weighs on both frameworks alike. Ratios and efficiencies are
    # taken within a round, from runs minutes apart at most, then the median.
    raw = {m: {} for m in models}
    frameworks = ["lockstep"] + [DDP_VARIANTS[v] for v in variants]
    for rnd in range(rounds):
        for model in models:
            cfg = configs[model]
            sequence = [(fw, r) for fw in frameworks for r in rank_counts]
            if rnd % 2 == 1:
                sequence.reverse()
            for fw, ranks in sequence:
                if fw == "lockstep":
                    cmd = lockstep_cmd(args, binary, model, ranks, cfg)
                else:
                    variant = next(v for v, k in DDP_VARIANTS.items() if k == fw)
                    cmd = ddp_cmd(args, model, ranks, cfg, variant)
                log(f"round {rnd + 1}/{rounds}: {fw} {model} on {ranks} rank(s)")
                result, err = run(cmd, args.timeout)
                if err:
                    errors.append(err)
                    log(err)
                    continue
                result["round"] = rnd
                raw[model].setdefault(fw, {}).setdefault(str(ranks), []).append(result)

    # 3. Summaries and derived numbers.
    results = {"models": {}}
    for model in models:
        cfg = configs[model]
        m = {"title": MODEL_TITLES[model], "batch_per_rank": cfg["batch"], "optimizer": args.optimizer}
        for fw, by_ranks in raw[model].items():
            first = next(iter(by_ranks.values()))[0]
            m.setdefault("parameters", first["parameters"])
            m.setdefault("gradient_bytes", first["gradient_bytes"])
            if fw == "lockstep":
                m["parameter_bytes"] = first.get("parameter_bytes")
                m["bucket_bytes"] = first.get("bucket_bytes")
            if first["parameters"] != m["parameters"]:
                errors.append(f"{model}: {fw} has {first['parameters']} parameters, lockstep {m['parameters']}")
            entries = {ranks: summarize(by_ranks[ranks]) for ranks in sorted(by_ranks, key=int)}
            for ranks, entry in entries.items():
                add_derived(entry, int(ranks), cfg["batch"], entries.get("1"))
                # The efficiency of each round, from that round's 1-rank run.
                per_round = []
                for rnd in range(rounds):
                    t1 = round_step_ms(by_ranks.get("1", []), rnd)
                    tn = round_step_ms(by_ranks[ranks], rnd)
                    if t1 and tn:
                        per_round.append(t1 / tn)
                entry["efficiency_per_round"] = per_round
                if per_round:
                    entry["efficiency"] = median(per_round)
            m[fw] = entries
        for fw in frameworks[1:]:
            if fw in m and "lockstep" in m:
                ratios, per_round = {}, {}
                for r in m["lockstep"]:
                    if r not in m[fw]:
                        continue
                    rr = [round_step_ms(raw[model]["lockstep"][r], rnd) / round_step_ms(raw[model][fw][r], rnd)
                          for rnd in range(rounds)
                          if round_step_ms(raw[model]["lockstep"][r], rnd) and round_step_ms(raw[model][fw][r], rnd)]
                    per_round[r] = rr
                    ratios[r] = median(rr) if rr else m["lockstep"][r]["step_ms"] / m[fw][r]["step_ms"]
                m[f"step_time_ratio_lockstep_over_{fw}"] = ratios
                m[f"step_time_ratio_lockstep_over_{fw}_per_round"] = per_round
        results["models"][model] = m

    # 4. The cost model, checked here, and the cluster projection.
    cost = None
    if "2" in collectives:
        alpha, bus = fit_allreduce(collectives["2"], 2)
        cost = {"fitted_on_ranks": 2, "alpha_us": alpha * 1e6, "bus_bandwidth_gbps": bus / 1e9, "check": {}}
        for model, m in results["models"].items():
            ls = m.get("lockstep", {})
            if "1" not in ls or "2" not in ls or not m.get("parameter_bytes"):
                continue
            one, two = ls["1"], ls["2"]
            buckets = buckets_of(m["parameter_bytes"], m["bucket_bytes"])
            ar = lambda s: ring_allreduce_s(s, 2, alpha, bus)
            # Compute at 2 ranks is what the ranks achieve without communicating
            # (nosync): this host's cores share memory bandwidth and caches.
            compute_2 = (two["nosync_step_ms"] or one["step_ms"]) / 1e3
            parts = compute_parts(two, compute_2)
            predicted, comm = predict_step_s(parts, buckets, ar)
            # The same model with the all-reduce time measured at each bucket's size
            # (the single alpha/B fit misses that cache-resident messages are faster).
            predicted_m, comm_m = predict_step_s(parts, buckets, measured_allreduce_s(collectives["2"]))
            cost["check"][model] = {
                "buckets_bytes": buckets,
                "compute_ms": compute_2 * 1e3,
                "predicted_comm_ms": comm * 1e3,
                "predicted_step_ms": predicted * 1e3,
                "predicted_comm_ms_measured_allreduce": comm_m * 1e3,
                "predicted_step_ms_measured_allreduce": predicted_m * 1e3,
                "measured_step_ms": two["step_ms"],
                "predicted_efficiency": one["step_ms"] / (predicted * 1e3),
                "predicted_efficiency_measured_allreduce": one["step_ms"] / (predicted_m * 1e3),
                "measured_efficiency": two["efficiency"],
            }
    projection = project(results, args)

    # 5. The targets of issue 8, at 2 ranks, against each DDP variant.
    targets = {}
    limits = {"small_mlp": 0.5, "wide_mlp": 0.75, "cnn": 1.0}
    for fw in frameworks[1:]:
        for model, m in results["models"].items():
            if fw in m and "lockstep" in m and "2" in m[fw] and "2" in m["lockstep"]:
                ratio = m[f"step_time_ratio_lockstep_over_{fw}"]["2"]
                eff_l, eff_d = m["lockstep"]["2"]["efficiency"], m[fw]["2"]["efficiency"]
                targets.setdefault(fw, {})[model] = {
                    "step_time_ratio": ratio, "limit": limits[model], "ratio_met": ratio <= limits[model],
                    "efficiency_lockstep": eff_l, "efficiency_ddp": eff_d, "efficiency_met": eff_l > eff_d}

    results.update({
        "command": shlex.join([os.path.relpath(sys.argv[0], ROOT)] + (argv if argv is not None else sys.argv[1:])),
        "machine": {"hostname": platform.node(), "cores": cores, "python_torch": torch_version,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S")},
        "settings": {"quick": args.quick, "rank_counts": rank_counts, "rounds": rounds, "optimizer": args.optimizer,
                     "threads_per_rank": args.threads, "ddp_variants": variants,
                     "per_model": {m: configs[m] for m in models}},
        "collectives": collectives,
        "cost_model": cost,
        "projection": projection,
        "targets": targets,
        "errors": errors,
        "seconds": time.monotonic() - started,
    })
    results["plots"] = write_plots(results, out_dir, frameworks)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print_report(results, frameworks)
    print(f"\nresults: {os.path.join(out_dir, 'results.json')}; plots: "
          + ", ".join(os.path.join(out_dir, p) for p in results["plots"]))
    for e in errors:
        log(f"error: {e}")
    return 1 if errors else 0


def print_report(results, frameworks):
    s = results["settings"]
    print(f"Scale-out benchmark: {results['machine']['cores']} cores, ranks {s['rank_counts']}, {s['rounds']} "
          f"round(s), {s['optimizer']}, {s['threads_per_rank']} intra-op thread(s) per rank; weak scaling (same "
          f"per-rank batch); medians")
    for model, m in results["models"].items():
        rows = []
        for fw in frameworks:
            for ranks, e in m.get(fw, {}).items():
                ratio = m.get(f"step_time_ratio_lockstep_over_{fw}", {}).get(ranks) if fw != "lockstep" else None
                rows.append([fw, ranks, fmt(e["step_ms"], ".3f"), fmt(e["examples_per_s"], ".0f"),
                             fmt(e["efficiency"]), fmt(e.get("nosync_step_ms"), ".3f"),
                             fmt(100 * e["comm_share"], ".0f") + "%",
                             (fmt(100 * e["comm_wait_share"], ".0f") + "%") if e.get("comm_wait_share") is not None
                             else "-", fmt(e["max_rss_mib"], ".0f"), fmt(ratio)])
        print_table(f"{m['title']} ({m.get('parameters', 0):,} parameters, per-rank batch {m['batch_per_rank']})",
                    ["framework", "ranks", "step ms", "examples/s", "efficiency", "nosync ms", "comm share",
                     "comm wait", "peak RSS MiB", "lockstep/this"], rows)
    for n, rows in results["collectives"].items():
        print_table(f"All-reduce, float32, {n} ranks (busbw = algbw * 2(n-1)/n; lockstep: a gradient bucket's "
                    f"buffer, shared memory on one host; plain: an ordinary tensor, through MPI; gloo: the Gloo "
                    f"communicator, loopback TCP)",
                    ["bytes", "lockstep ms", "algbw GB/s", "busbw GB/s", "plain ms", "MPI_Allreduce ms", "algbw GB/s",
                     "busbw GB/s", "gloo ms", "gloo busbw GB/s"],
                    [[r["bytes"], fmt(r["lockstep_s"] * 1e3, ".3f"), fmt(r["lockstep_algbw_gbps"]),
                      fmt(r["lockstep_busbw_gbps"]),
                      fmt(r["lockstep_plain_s"] * 1e3 if r.get("lockstep_plain_s") is not None else None, ".3f"),
                      fmt(r["mpi_s"] * 1e3, ".3f"), fmt(r["mpi_algbw_gbps"]), fmt(r["mpi_busbw_gbps"]),
                      fmt(r["gloo_s"] * 1e3 if r.get("gloo_s") is not None else None, ".3f"),
                      fmt(r.get("gloo_busbw_gbps"))]
                     for r in rows])
    cost = results["cost_model"]
    if cost:
        print_table(f"Cost model against this machine, 2 ranks (alpha {cost['alpha_us']:.1f} us, bus bandwidth "
                    f"{cost['bus_bandwidth_gbps']:.2f} GB/s fitted on Lockstep's all-reduce)",
                    ["model", "buckets", "compute ms", "comm ms", "predicted ms", "eff", "| T(S) measured: comm ms",
                     "predicted ms", "eff", "| measured ms", "eff"],
                    [[model, len(ch["buckets_bytes"]), fmt(ch["compute_ms"], ".3f"), fmt(ch["predicted_comm_ms"], ".3f"),
                      fmt(ch["predicted_step_ms"], ".3f"), fmt(ch["predicted_efficiency"]),
                      fmt(ch["predicted_comm_ms_measured_allreduce"], ".3f"),
                      fmt(ch["predicted_step_ms_measured_allreduce"], ".3f"),
                      fmt(ch["predicted_efficiency_measured_allreduce"]), fmt(ch["measured_step_ms"], ".3f"),
                      fmt(ch["measured_efficiency"])]
                     for model, ch in cost["check"].items()])
    print_projection(results["projection"])
    for fw, by_model in results["targets"].items():
        print_table(f"Targets at 2 ranks against {fw} (Lockstep / DDP step time at most the limit; efficiency "
                    f"above DDP's; medians of per-round values)",
                    ["model", "ratio", "limit", "met", "eff lockstep", f"eff {fw}", "met"],
                    [[model, fmt(t["step_time_ratio"]), t["limit"], "yes" if t["ratio_met"] else "NO",
                      fmt(t["efficiency_lockstep"]), fmt(t["efficiency_ddp"]), "yes" if t["efficiency_met"] else "NO"]
                     for model, t in by_model.items()])
    print(f"\n{results['seconds']:.0f} s in all")


def print_projection(p):
    cl = p["cluster"]
    print_table(f"Projection: {cl['hosts']} host(s) x {cl['gpus_per_host']} GPUs, NVLink {cl['nvlink_gbps']:g} GB/s, "
                f"network {cl['network_gbps']:g} GB/s per host, compute {cl['compute_speedup']:g}x this machine's",
                ["model", "ranks", "hosts", "step ms", "comm ms", "efficiency"],
                [[model, pt["ranks"], pt["hosts"], fmt(pt["step_ms"], ".3f"), fmt(pt["comm_ms"], ".3f"),
                  fmt(pt["efficiency"])] for model, curve in p["models"].items() for pt in curve])


def write_plots(results, out_dir, frameworks):
    written = []

    def save(name, svg):
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(svg)
        written.append(name)

    models = results["models"]
    series = []
    for i, (model, m) in enumerate(models.items()):
        for fw in frameworks:
            pts = [(int(r), e["efficiency"]) for r, e in m.get(fw, {}).items() if e.get("efficiency") is not None]
            if pts:
                series.append({"label": f"{fw} {model}", "points": pts, "dashed": fw != "lockstep",
                               "color": svg_plot.COLORS[i]})
    save("scaling_efficiency.svg", svg_plot.line_chart("Weak-scaling efficiency (measured)", "ranks",
                                                       "throughput_N / (N x throughput_1)", series, log_x=True,
                                                       y_min=0, y_max=1.05))
    for model, m in models.items():
        series = []
        for k, fw in enumerate(frameworks):
            pts = [(int(r), e["examples_per_s"]) for r, e in m.get(fw, {}).items()]
            if pts:
                series.append({"label": fw, "points": pts, "color": svg_plot.COLORS[k]})
        ls = m.get("lockstep", {})
        if "1" in ls:
            series.append({"label": "lockstep ideal", "dashed": True, "color": "#999",
                           "points": [(int(r), int(r) * ls["1"]["examples_per_s"]) for r in ls]})
        save(f"throughput_{model}.svg", svg_plot.line_chart(f"{m['title']}: throughput", "ranks", "examples/s",
                                                           series, log_x=True, y_min=0))
        groups = []
        for fw in frameworks:
            for r, e in m.get(fw, {}).items():
                compute = e["nosync_step_ms"] if e.get("nosync_step_ms") else e["step_ms"]
                parts = compute_parts(e, compute / 1e3)
                comm = max(0.0, e["step_ms"] - compute)
                groups.append((f"{fw}\n{r} rank(s)", [parts["forward"] * 1e3, parts["backward"] * 1e3,
                                                      parts["optimizer"] * 1e3, parts["other"] * 1e3, comm]))
        save(f"breakdown_{model}.svg", svg_plot.stacked_bars(
            f"{m['title']}: step time", "ms per step", groups,
            ["forward", "backward", "optimizer", "other", "communication"]))
    for n, rows in results["collectives"].items():
        series = [{"label": "Lockstep, bucket buffer", "points": [(r["bytes"], r["lockstep_busbw_gbps"]) for r in rows]}]
        if all(r.get("lockstep_plain_busbw_gbps") for r in rows):
            series.append({"label": "Lockstep, plain tensor",
                           "points": [(r["bytes"], r["lockstep_plain_busbw_gbps"]) for r in rows]})
        series.append({"label": "MPI_Allreduce", "points": [(r["bytes"], r["mpi_busbw_gbps"]) for r in rows],
                       "dashed": True})
        save(f"allreduce_{n}ranks.svg", svg_plot.line_chart(f"All-reduce bus bandwidth, float32, {n} ranks",
                                                            "message size", "busbw GB/s", series, log_x=True, y_min=0,
                                                            x_format=svg_plot.format_bytes))
    p = results["projection"]
    if p["models"]:
        series = [{"label": model, "points": [(pt["ranks"], pt["efficiency"]) for pt in curve]}
                  for model, curve in p["models"].items()]
        cl = p["cluster"]
        save("projection.svg", svg_plot.line_chart(
            f"Projected efficiency: {cl['hosts']}x{cl['gpus_per_host']} GPUs, {cl['network_gbps']:g} GB/s network",
            "ranks", "efficiency", series, log_x=True, y_min=0, y_max=1.05))
    return written


if __name__ == "__main__":
    sys.exit(main())
