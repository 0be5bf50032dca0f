"""Plot a results file: one PNG per benchmark line (each spread as its median with the min-max range),
and for step-caching lines also speedup against quality (fvgraph/plots.py).

    python perf/plot_results.py perf/results/2026-12-01-cpu.jsonl --out perf/results/plots
    python perf/plot_results.py perf/results/2026-12-01-cpu.jsonl --bench interceptors

Files are named <results file stem>-<line number>-<bench>.png (and -tradeoff.png); the paths are printed,
and then, on standard error, which lines were skipped and why (another --bench, or no min / median /
max spreads to draw: a line of counts or settings only).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fvgraph.plots import plot_bench_line, plot_caching_tradeoff, spreads


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a perf/results/*.jsonl file")
    parser.add_argument("--out", type=Path, default=Path("plots"), help="folder for the PNGs")
    parser.add_argument("--bench", help="only lines of this bench")
    args = parser.parse_args(argv)
    written = []
    lines = 0
    skipped: dict[str, list[str]] = {"of another bench": [], "without spreads": [], "not an object": []}
    for number, text in enumerate(args.results.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        lines += 1
        try:
            line = json.loads(text)
        except json.JSONDecodeError as err:
            raise SystemExit(f"{args.results}:{number}: not a JSON line ({err})") from None
        if not isinstance(line, dict):
            skipped["not an object"].append(str(number))
            continue
        label = f"{number} ({line.get('bench', '?')})"
        if args.bench and line.get("bench") != args.bench:
            skipped["of another bench"].append(label)
            continue
        if not any(spreads(line)):
            skipped["without spreads"].append(label)
            continue
        stem = args.out / f"{args.results.stem}-{number}-{line.get('bench', 'bench')}"
        written.append(plot_bench_line(line, stem.with_suffix(".png")))
        if isinstance(line.get("methods"), dict):
            written.append(plot_caching_tradeoff(line, Path(f"{stem}-tradeoff.png")))
    for path in written:
        print(path)
    print(skipped_report(args.results, lines, skipped), file=sys.stderr)
    return written


def skipped_report(results: Path, lines: int, skipped: dict[str, list[str]]) -> str:
    """One line: how many of the file's lines were drawn, and which were skipped and why."""
    count = sum(len(numbers) for numbers in skipped.values())
    reasons = "; ".join(f"{len(numbers)} {why}: lines {', '.join(numbers)}" for why, numbers in skipped.items() if numbers)
    return f"{results}: plotted {lines - count} of {lines} lines" + (f", skipped {count} ({reasons})" if count else "")


if __name__ == "__main__":
    main()
