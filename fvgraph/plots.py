"""Plots of what the commands print as JSON: a parity report's error per tap and step, a benchmark
line's timings with their spreads, and step caching's speedup against its quality (matplotlib, no
screen needed).

    fvgraph parity -O1 --against 0 --plot parity.png
    python perf/plot_results.py perf/results/2026-12-01-cpu.jsonl --out plots/

A benchmark line holds its timings as spreads, {"repeats", "min", "median", "max"} dicts at any depth
(perf/method.py); `plot_bench_line` draws every spread of one line as its median with the min-max
range, one panel per unit, labelled in words, on axes from zero (log where values span decades) with
the 1.0 line on ratios.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

SPREAD_KEYS = {"min", "median", "max"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    return plt


def plot_parity(report, path: str | Path) -> Path:
    """A ParityReport (fvgraph/parity.py) as a tap x step heatmap of max |a - b| on a log scale, the
    tolerance's atol drawn on the colour bar, failing cells outlined and the first divergence marked."""
    plt = _pyplot()
    from matplotlib.colors import LogNorm

    comparisons = report.comparisons
    if not comparisons:
        raise ValueError("the parity report has no comparisons to plot")
    columns = sorted({(c.request, c.step) for c in comparisons})
    taps = list(dict.fromkeys(c.tap for c in comparisons))  # execution order, as compared
    grid = [[math.nan] * len(columns) for _ in taps]
    for c in comparisons:
        grid[taps.index(c.tap)][columns.index((c.request, c.step))] = max(c.max_abs, 1e-12)
    atol = report.config.get("atol")
    values = [v for row in grid for v in row if not math.isnan(v)]
    low, high = min(values + ([atol] if atol else [])), max(values + ([atol] if atol else []))
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(columns) + 3), max(3, 0.28 * len(taps) + 1.5)))
    # headroom on both ends, so the tolerance line sits inside the colour bar
    image = ax.imshow(grid, aspect="auto", cmap="viridis", norm=LogNorm(vmin=low / 2, vmax=max(high * 3, low * 10)))
    bar = fig.colorbar(image, ax=ax, label="max |a - b|, log scale" + (f" (red line: atol {atol:g})" if atol else ""))
    if atol:
        bar.ax.axhline(atol, color="red", linewidth=2)
    for c in comparisons:
        if not c.passed:
            ax.add_patch(plt.Rectangle((columns.index((c.request, c.step)) - 0.5, taps.index(c.tap) - 0.5), 1, 1,
                                       fill=False, edgecolor="red", linewidth=1.5))  # fmt: skip
    first = report.first_divergence
    if first is not None:
        ax.plot(columns.index((first.request, first.step)), taps.index(first.tap), marker="*", color="white",
                markersize=16, markeredgecolor="red")  # fmt: skip
    ax.set_xticks(range(len(columns)), [f"r{r} s{s}" for r, s in columns], rotation=90, fontsize=7)
    ax.set_yticks(range(len(taps)), taps, fontsize=7)
    ax.set_xlabel("request r, denoise step s")
    ax.set_ylabel("tap (execution order)")
    verdict = "passed" if report.passed else f"first divergence: r{first.request} s{first.step} {first.tap}"
    ax.set_title(f"parity {report.config.get('a')} vs {report.config.get('b')} on {report.config.get('card')}: {verdict}", fontsize=9)
    return _save(fig, plt, path)


def spreads(line: dict, prefix: str = "") -> Iterator[tuple[str, dict]]:
    """Every spread in a benchmark line, with its key path ("methods.magcache.fvgraph.wall_ms")."""
    for key, value in line.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            if SPREAD_KEYS <= set(value) and all(isinstance(value[k], int | float) for k in SPREAD_KEYS):
                yield name, value
            else:
                yield from spreads(value, name)


def _unit(name: str) -> str:
    """The unit a spread is in, from the nearest part of its key path that names one."""
    for part in reversed(name.split(".")):
        if "ratio" in part or "speedup" in part or "_over_" in part or "_vs_" in part:
            return "ratio"
        if "gflop" in part:
            return "GFLOP/s"
        if part.endswith("_per_s"):  # samples_per_s: samples/s
            return part[: -len("_per_s")].replace("_", " ") + "/s"
        if part.startswith(("s_per_", "ms_per_", "us_per_")):  # seconds (ms, us) per something
            return part.split("_", 1)[0]
        if part.endswith("_percent"):
            return "%"
        for marker, unit in (("_ms", "ms"), ("_us", "us"), ("seconds", "s"), ("_s", "s")):
            if part.endswith(marker) or f"{marker}_" in part:
                return unit
    return name.rsplit(".", 1)[-1].replace("_", " ")


_UNIT_WORDS = {"ms", "us", "s", "percent"}


def readable(name: str) -> str:
    """A spread's key path as a label: "per_step_ms.fvgraph_O1" -> "per step / fvgraph O1" (the unit
    goes on the axis, so unit words are dropped; a part that is only a unit is dropped whole)."""
    words = []
    for part in name.split("."):
        tokens = part.split("_")
        if "gflops" in tokens or part.endswith("_per_s"):  # the axis says GFLOP/s, samples/s
            continue
        kept = [t for i, t in enumerate(tokens) if not (t in _UNIT_WORDS and i in (0, len(tokens) - 1))]
        if kept:
            words.append(" ".join(kept))
    return " / ".join(words) or name


_UNIT_NAMES = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "%": "percent", "ratio": "ratio, x (dashed: 1.0)"}


def _axis_label(unit: str) -> str:
    return f"{_UNIT_NAMES.get(unit, unit)} (median, bar: min-max)"


def bench_line_figure(line: dict):
    """The figure `plot_bench_line` saves: a panel per unit, each spread's median (dot) and min-max
    range (bar). Every axis starts at zero, so ratios between bars read true, unless the values span
    two decades or more, where the axis is logarithmic and says so; ratio panels draw the 1.0 line."""
    plt = _pyplot()
    found = list(spreads(line))
    if not found:
        raise ValueError(f"benchmark line {line.get('bench')!r} holds no min / median / max spreads")
    panels: dict[str, list[tuple[str, dict]]] = {}
    for name, spread in found:
        panels.setdefault(_unit(name), []).append((name, spread))
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, sum(0.35 * len(v) + 1.4 for v in panels.values())), squeeze=False)
    for ax, (unit, rows) in zip(axes[:, 0], panels.items()):
        ys = range(len(rows))
        medians = [s["median"] for _, s in rows]
        ax.errorbar(medians, ys, xerr=[[m - s["min"] for m, (_, s) in zip(medians, rows)],
                                       [s["max"] - m for m, (_, s) in zip(medians, rows)]],  # fmt: skip
                    fmt="o", capsize=3)
        ax.set_yticks(list(ys), [readable(name) for name, _ in rows], fontsize=7)
        ax.invert_yaxis()  # the line's own order, top down
        lows, highs = [s["min"] for _, s in rows], [s["max"] for _, s in rows]
        label = _axis_label(unit)
        if min(lows) > 0 and max(highs) / min(lows) >= 100:
            ax.set_xscale("log")
            label += ", log scale"
        else:
            ax.set_xlim(left=0, right=(max(max(highs), 1.0 if unit == "ratio" else 0.0) * 1.08) or 1.0)
        if unit == "ratio":
            ax.axvline(1.0, color="grey", linewidth=1, linestyle="--")
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
    axes[0, 0].set_title(f"{line.get('bench')} on {line.get('card', '?')} (commit {line.get('commit', '?')})", fontsize=9)
    return fig


def plot_bench_line(line: dict, path: str | Path) -> Path:
    """One benchmark JSON line as a PNG (bench_line_figure)."""
    return _save(bench_line_figure(line), _pyplot(), path)


def plot_caching_tradeoff(line: dict, path: str | Path) -> Path:
    """A bench_interceptors line: each method's median speedup (with its range) against its quality
    (final relative L2 of the latents against the uncached run)."""
    plt = _pyplot()
    methods = line.get("methods")
    if not isinstance(methods, dict):
        raise ValueError(f"benchmark line {line.get('bench')!r} has no 'methods' to plot speedup against quality")
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, method in methods.items():
        speedup, quality = method.get("fvgraph", {}).get("speedup"), method.get("quality", {})
        if speedup is None or quality.get("final_rel_l2") is None:
            continue
        m = speedup["median"]
        ax.errorbar(quality["final_rel_l2"], m, yerr=[[m - speedup["min"]], [speedup["max"] - m]], fmt="o", capsize=3)
        ax.annotate(name, (quality["final_rel_l2"], m), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=1, linestyle="--")  # 1.0: as fast as uncached
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("final relative L2 against the uncached latents (0: identical)")
    ax.set_ylabel("speedup over uncached (x)")
    ax.set_title(f"step caching on {line.get('card', '?')}, {line.get('steps', '?')} steps: median speedup, bar min-max, "
                 "dashed 1.0", fontsize=8)  # fmt: skip
    ax.grid(alpha=0.3)
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
