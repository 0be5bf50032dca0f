"""Plot a results file: one PNG per benchmark line (each spread as its median with the min-max range),
and for step-caching lines also speedup against quality (fvgraph/plots.py).

    python perf/plot_results.py perf/results/2026-12-01-cpu.jsonl --out perf/results/plots
    python perf/plot_results.py perf/results/2026-12-01-cpu.jsonl --bench interceptors

Files are named <results file stem>-<line number>-<bench>.png (and -tradeoff.png); the paths are printed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fvgraph.plots import plot_bench_line, plot_caching_tradeoff, spreads


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a perf/results/*.jsonl file")
    parser.add_argument("--out", type=Path, default=Path("plots"), help="folder for the PNGs")
    parser.add_argument("--bench", help="only lines of this bench")
    args = parser.parse_args(argv)
    written = []
    for number, text in enumerate(args.results.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as err:
            raise SystemExit(f"{args.results}:{number}: not a JSON line ({err})") from None
        if not isinstance(line, dict) or (args.bench and line.get("bench") != args.bench) or not any(spreads(line)):
            continue
        stem = args.out / f"{args.results.stem}-{number}-{line.get('bench', 'bench')}"
        written.append(plot_bench_line(line, stem.with_suffix(".png")))
        if isinstance(line.get("methods"), dict):
            written.append(plot_caching_tradeoff(line, Path(f"{stem}-tradeoff.png")))
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
