#!/usr/bin/env python3
"""Draws one traced step of Lockstep's Chrome traces (trace_steps) as an SVG.

    tools/timeline_svg.py RUN/trace/rank_*.json --step 20 -o step20.svg

One band per rank, one row per track (the step, the training thread, each
gradient bucket), time from the step's start on the earliest rank. The ranks of
one host share the clock; ranks of other hosts are drawn as they are.
Standard library only.
"""
import argparse
import json
import re
import sys
from xml.sax.saxutils import escape

COLORS = [
    ("data wait", "#9e9e9e"),
    ("forward", "#1f77b4"),
    ("backward", "#ff7f0e"),
    ("wait", "#d62728"),
    ("bucket", "#2ca02c"),
    ("norms and optimizer", "#9467bd"),
    ("finish gradient exchange", "#f7b6d2"),
    ("step", "#dddddd"),
]


def color(name):
    for prefix, value in COLORS:
        if name.startswith(prefix):
            return value
    return "#8c564b"


def load(paths):
    ranks = {}
    for path in paths:
        try:
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"timeline_svg: {path} is not a Lockstep trace: {e}")
        for e in events:
            if e.get("ph") == "M" and e["name"] == "thread_name":
                ranks.setdefault(e["pid"], {"tracks": {}, "spans": []})["tracks"][e["tid"]] = e["args"]["name"]
            elif e.get("ph") == "X":
                ranks.setdefault(e["pid"], {"tracks": {}, "spans": []})["spans"].append(e)
    return ranks


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--step", type=int, help="the step to draw (default: the last traced)")
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    ranks = load(args.traces)
    if not ranks:
        sys.exit("timeline_svg: no events in " + " ".join(args.traces))
    steps = sorted({int(m.group(1)) for r in ranks.values() for s in r["spans"]
                    if (m := re.fullmatch(r"step (\d+)", s["name"]))})
    if not steps:
        sys.exit("timeline_svg: no traced step in the files")
    step = args.step if args.step is not None else steps[-1]
    if step not in steps:
        sys.exit(f"timeline_svg: step {step} is not traced; traced: {steps}")
    # Each rank's spans within its step span.
    windows = {}
    for pid, r in ranks.items():
        for s in r["spans"]:
            if s["name"] == f"step {step}":
                windows[pid] = (s["ts"], s["ts"] + s["dur"])
    t0 = min(w[0] for w in windows.values())
    t1 = max(w[1] for w in windows.values())
    span_ms = (t1 - t0) / 1000.0

    left, right, top, row_h, gap = 190, 30, 50, 18, 14
    width = 1000
    plot_w = width - left - right
    rows = []
    for pid in sorted(windows):
        start, end = windows[pid]
        spans = [s for s in ranks[pid]["spans"] if s["ts"] >= start - 1 and s["ts"] + s["dur"] <= end + 1]
        tracks = sorted({s["tid"] for s in spans})
        for tid in tracks:
            rows.append((pid, tid, ranks[pid]["tracks"].get(tid, f"track {tid}"), [s for s in spans if s["tid"] == tid]))
    height = top + len(rows) * row_h + gap * len(windows) + 70

    def x(ts):
        return left + (ts - t0) / (t1 - t0) * plot_w if t1 > t0 else left

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left}" y="20" font-size="14">{escape(args.title or f"Step {step}")} ({span_ms:.1f} ms)</text>']
    y = top
    last_pid = None
    for pid, tid, name, spans in rows:
        if last_pid is not None and pid != last_pid:
            y += gap
        label = f"rank {pid}: {name}"
        out.append(f'<text x="{left - 6}" y="{y + row_h - 5}" text-anchor="end">{escape(label)}</text>')
        for s in spans:
            x0, x1 = x(s["ts"]), x(s["ts"] + s["dur"])
            w = max(x1 - x0, 0.8)
            h = row_h - 6 if tid != 0 else row_h - 10
            title = f'{s["name"]}: {s["dur"] / 1000.0:.2f} ms'
            out.append(f'<rect x="{x0:.1f}" y="{y + 3}" width="{w:.1f}" height="{h}" fill="{color(s["name"])}" '
                       f'stroke="white" stroke-width="0.3"><title>{escape(title)}</title></rect>')
        y += row_h
        last_pid = pid
    # Time axis.
    out.append(f'<line x1="{left}" y1="{y + 4}" x2="{left + plot_w}" y2="{y + 4}" stroke="black"/>')
    for i in range(6):
        t = span_ms * i / 5
        xx = left + plot_w * i / 5
        out.append(f'<line x1="{xx:.1f}" y1="{y + 4}" x2="{xx:.1f}" y2="{y + 8}" stroke="black"/>')
        out.append(f'<text x="{xx:.1f}" y="{y + 20}" text-anchor="middle">{t:.1f} ms</text>')
    # Legend.
    lx = left
    for name, value in COLORS[:-1]:
        out.append(f'<rect x="{lx}" y="{y + 32}" width="10" height="10" fill="{value}"/>')
        out.append(f'<text x="{lx + 14}" y="{y + 41}">{escape(name)}</text>')
        lx += 14 + 7 * len(name) + 14
    out.append("</svg>")
    with open(args.output, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"timeline_svg: step {step}, {len(windows)} rank(s), {span_ms:.1f} ms -> {args.output}")


if __name__ == "__main__":
    main()
