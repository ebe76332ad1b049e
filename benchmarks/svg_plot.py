"""A small SVG writer for the scale-out suite: line charts and grouped stacked
bars, with axes, ticks and a legend. Standard library only."""
import math
from xml.sax.saxutils import escape

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf"]
WIDTH, HEIGHT = 640, 400
LEFT, RIGHT, TOP, BOTTOM = 70, 180, 40, 50


def _nice_ticks(lo, hi, count=5):
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    t = first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(t, 12))
    return ticks


def format_bytes(v):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= size:
            return f"{v / size:g} {unit}"
    return f"{v:g} B"


def _fmt(v):
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-2:
        return f"{v:.0e}"
    return f"{v:g}"


class _Canvas:
    def __init__(self, title):
        self.parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
            f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
            f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
        ]

    def add(self, text):
        self.parts.append(text)

    def text(self, x, y, s, anchor="start", **attrs):
        extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
        self.add(f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{extra}>{escape(str(s))}</text>')

    def legend(self, entries):
        x = WIDTH - RIGHT + 15
        for i, (label, color, dashed) in enumerate(entries):
            y = TOP + 10 + 18 * i
            dash = ' stroke-dasharray="5,3"' if dashed else ""
            self.add(f'<line x1="{x}" y1="{y}" x2="{x + 20}" y2="{y}" stroke="{color}" stroke-width="3"{dash}/>')
            self.text(x + 26, y + 4, label)

    def done(self):
        return "\n".join(self.parts + ["</svg>"]) + "\n"


def line_chart(title, x_label, y_label, series, log_x=False, y_min=None, y_max=None, x_format=None):
    """series: list of dicts {label, points: [(x, y)], dashed: bool}; x_format
    formats the x ticks (default: numbers). Returns SVG text."""
    c = _Canvas(title)
    xs = [x for s in series for x, _ in s["points"]]
    ys = [y for s in series for _, y in s["points"]]
    if not xs:
        xs, ys = [0, 1], [0, 1]
    tx = (lambda v: math.log2(v)) if log_x else (lambda v: v)
    x_lo, x_hi = min(tx(x) for x in xs), max(tx(x) for x in xs)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    y_lo = min(ys) if y_min is None else min(y_min, min(ys))
    y_hi = max(ys) if y_max is None else max(y_max, max(ys))
    y_ticks = _nice_ticks(y_lo, y_hi)
    y_lo, y_hi = min(y_ticks[0], y_lo), max(y_ticks[-1], y_hi)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    px = lambda v: LEFT + (tx(v) - x_lo) / (x_hi - x_lo) * plot_w
    py = lambda v: TOP + plot_h - (v - y_lo) / (y_hi - y_lo) * plot_h
    c.add(f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#888"/>')
    for t in y_ticks:
        c.add(f'<line x1="{LEFT}" y1="{py(t):.1f}" x2="{LEFT + plot_w}" y2="{py(t):.1f}" stroke="#eee"/>')
        c.text(LEFT - 6, py(t) + 4, _fmt(t), "end")
    for x in sorted(set(xs)):
        c.add(f'<line x1="{px(x):.1f}" y1="{TOP + plot_h}" x2="{px(x):.1f}" y2="{TOP + plot_h + 5}" stroke="#888"/>')
        c.text(px(x), TOP + plot_h + 18, (x_format or _fmt)(x), "middle", font_size="10")
    c.text(LEFT + plot_w / 2, HEIGHT - 12, x_label, "middle")
    c.text(16, TOP + plot_h / 2, y_label, "middle", transform=f"rotate(-90 16 {TOP + plot_h / 2})")
    legend = []
    for i, s in enumerate(series):
        color = s.get("color") or COLORS[i % len(COLORS)]
        pts = sorted(s["points"])
        dash = ' stroke-dasharray="5,3"' if s.get("dashed") else ""
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        c.add(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        for x, y in pts:
            c.add(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>')
        legend.append((s["label"], color, s.get("dashed", False)))
    c.legend(legend)
    return c.done()


def stacked_bars(title, y_label, groups, segment_names):
    """groups: list of (bar label, [segment values in segment_names order]). Returns SVG text."""
    c = _Canvas(title)
    totals = [sum(v for v in values if v > 0) for _, values in groups] or [1.0]
    y_ticks = _nice_ticks(0, max(totals) or 1.0)
    y_hi = y_ticks[-1]
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    py = lambda v: TOP + plot_h - v / y_hi * plot_h
    c.add(f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#888"/>')
    for t in y_ticks:
        c.add(f'<line x1="{LEFT}" y1="{py(t):.1f}" x2="{LEFT + plot_w}" y2="{py(t):.1f}" stroke="#eee"/>')
        c.text(LEFT - 6, py(t) + 4, _fmt(t), "end")
    c.text(16, TOP + plot_h / 2, y_label, "middle", transform=f"rotate(-90 16 {TOP + plot_h / 2})")
    slot = plot_w / max(1, len(groups))
    bar_w = slot * 0.6
    for i, (label, values) in enumerate(groups):
        x = LEFT + slot * i + (slot - bar_w) / 2
        base = 0.0
        for k, v in enumerate(values):
            if v <= 0:
                continue
            c.add(f'<rect x="{x:.1f}" y="{py(base + v):.1f}" width="{bar_w:.1f}" height="{py(base) - py(base + v):.1f}" '
                  f'fill="{COLORS[k % len(COLORS)]}"/>')
            base += v
        for j, line in enumerate(label.split("\n")):
            c.text(x + bar_w / 2, TOP + plot_h + 16 + 13 * j, line, "middle", font_size="10")
    c.legend([(name, COLORS[k % len(COLORS)], False) for k, name in enumerate(segment_names)])
    return c.done()
