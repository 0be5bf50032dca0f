"""Scheduler overhead: time per tick spent outside the compiled step, per batch it runs.

    python perf/bench_scheduler_overhead.py            # CPU, -O1, the inductor-compiled wan-cpu-bench step
    python perf/bench_scheduler_overhead.py --gpu      # CUDA, -O2: the step is a CUDA graph replay
    python perf/bench_scheduler_overhead.py --against-commit SHA   # A/B: SHA's tree vs this one, one run
    python perf/bench_scheduler_overhead.py --phases   # also the overhead by phase, us per batch
    python perf/bench_scheduler_overhead.py --stand-in # also with the step stood in for: warm vs evicted caches
    python perf/bench_scheduler_overhead.py --stand-in host   # the host's own cost alone (any of the modes below)
    python perf/bench_scheduler_overhead.py --against-commit SHA --stand-in   # A/B of the host cost alone
    python perf/bench_scheduler_overhead.py --stand-in host --preview-every 1   # host cost of step previews (A/B)
    python perf/bench_scheduler_overhead.py --idle --gpu   # device idle between replays, serial vs run-ahead (perf/replay_idle.py)

Runs a mix of requests at the smallest shape (1 frame, 32x32: the step is kept short, since it is
subtracted; different seeds, guidance scales and step counts; 16 in flight, batch buckets 1/2/4/8)
and times everything the engine does around the step
itself: grouping plans, filling static buffers and padding, hoisted values, scattering results,
loop bookkeeping. Timed apart and subtracted: the step (the compiled callable, or on a GPU the
CPU side of a graph replay), the per-request prologue it feeds (reported as its own figure, with
how many times it ran), request admission (validation, noise, sampler plan) and finalize (on a GPU
that is where the host waits for the device); the requests themselves are built before the clock
starts. Timed apart but not subtracted: the copies of hoisted values into batch rows (one per
arrival, and one per request moving rows; `hoisted_rows_copied` counts them). On a GPU they are
device copies queued behind the step; on a CPU they are memory traffic of megabytes per row, so the
line also gives the overhead less them. Prints one JSON line (fvgraph.perf.method): each figure as
min / median / max over `--repeats` runs, per batch and per request-step, and the target for the
mix: at most 100 us per batch plus 10 us per request in it (`--batch-sizes N` gives one bucket's).

With `--against-commit SHA` the same mix runs on SHA's tree and on this one, each in a worker process
of its own (perf/commit_tree.py), timed by this script's method on both: after both are warm, each
round times one mix on each side, the order alternating, never both at once. The line then holds
both spreads and the per-round ratio (this tree / SHA) of the overhead per batch. With `--stand-in`
as well, both sides run in the "host" mode below (each records its outputs from real runs first), so
the ratio is the host's own cost on both trees, as a GPU host pays it.

With `--stand-in` each round times the mix four times (each after an untimed run in the same mode),
the order rotating: with the real step, and
with perf/stand_in_step.py in its place returning recorded outputs, once as they are ("warm": the
host's caches as a GPU step leaves them), once after sweeping more memory than the last-level
cache ("evict": as the CPU step leaves them), and once with the prologues and the device copies
(texts into a prologue's buffers, hoisted rows) stood in for too ("host": no device work at all
touches the host's caches, as on a GPU). On the CPU the
gap between warm and step is what the step's memory traffic costs the host code after it, not host
work.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch


def _perf_module(name: str):
    """A module beside this file, loaded from its path: a worker on another commit's tree times with
    this tree's method and helpers, whatever `fvgraph.perf` is first on its path."""
    spec = importlib.util.spec_from_file_location(f"fvgraph_bench_{name}", Path(__file__).resolve().with_name(f"{name}.py"))
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


method, commit_tree, replay_idle = _perf_module("method"), _perf_module("commit_tree"), _perf_module("replay_idle")
stand_in_step = _perf_module("stand_in_step")
emit, paired_ratio, provenance, spread, sync = method.emit, method.paired_ratio, method.provenance, method.spread, method.sync


class Stopwatch:
    """Seconds spent inside wrapped callables, per label, each exclusive of the wrapped calls nested in
    it (the prologue inside filling the hoisted rows, next() inside a scheduler tick), so the labels
    add up to the time spent in all of them."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._nested: list[float] = []  # per open wrapped call: seconds spent in calls nested in it

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            began = time.perf_counter()
            self._nested.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - began
                self.seconds[label] += elapsed - self._nested.pop()
                if self._nested:
                    self._nested[-1] += elapsed

        timed.stopwatch, timed.__wrapped__ = self, fn
        return timed


def request_mix(n: int, steps: int, text_len: int, text_dim: int, seed: int = 0, preview_every: int | None = None) -> list:
    from fvgraph.request import Request

    g = torch.Generator().manual_seed(seed)
    embeds = lambda: torch.randn(text_len, text_dim, generator=g)  # noqa: E731
    previews = {} if preview_every is None else {"preview_every": preview_every}  # a tree without previews never sees the field
    return [
        Request(prompt_embeds=embeds(), negative_prompt_embeds=embeds(),
                seed=i, guidance_scale=2.0 + i % 4, num_inference_steps=steps - i % 3, num_frames=1, height=32,
                width=32, output_type="latent", **previews)  # fmt: skip
        for i in range(n)
    ]


# The target: at most this per batch plus this per request in it (each side's line gives it for its mix).
TARGET_US_PER_BATCH, TARGET_US_PER_REQUEST = 100, 10
SUBTRACTED = ("step", "prologue", "start", "finalize")  # timed apart: model work, admission, finalize
# --phases: where the time outside the step goes. Each label's callables, by (owner, attribute), are
# wrapped where the tree has them (an older or newer tree may lack some); "other" is what is left.
PHASES = {
    "schedule": [("scheduler", "tick"), ("scheduler", "continue_within_tick")],
    "next": [("loop", "next")],
    "static_inputs": [("runner", "_fill_inputs")],
    "hoisted_rows": [("runner", "_fill_hoisted")],
    "scatter": [("runner", "_scatter")],
    "host_outputs": [("fold_back", "copy_to_host")],
    "finite_check": [("fold_back", "all_finite"), ("graph_runner", "finite_rows")],
    "advance": [("loop", "advance")],
}


def instrument(engine: Engine, watch: Stopwatch, phases: bool = False) -> None:
    """Route the step, the prologues, admission and finalize through the stopwatch; with `phases`, also
    the callables of every PHASES label."""
    runner = engine.executor.runner
    runner._replay = watch.wrap("step", runner._replay)
    for entry in runner._graphs.values():  # the per-request prologue is compiled model work too
        if not hasattr(entry.compiled.prologue_fn, "stopwatch") and entry.compiled.prologue_fn is not None:
            entry.compiled.prologue_fn = watch.wrap("prologue", entry.compiled.prologue_fn)
    engine.start = watch.wrap("start", engine.start)
    if hasattr(runner, "_copy_hoisted"):  # an older tree copies hoisted rows inside _fill_hoisted
        runner._copy_hoisted = watch.wrap("row_copies", runner._copy_hoisted)
    engine.loop.finalize = watch.wrap("finalize", engine.loop.finalize)
    if phases:
        owners = {"scheduler": getattr(engine, "_scheduler", None), "loop": engine.loop, "runner": runner,
                  "fold_back": sys.modules.get("fvgraph.engine.fold_back"),
                  "graph_runner": sys.modules.get("fvgraph.runtime.graph_runner")}  # fmt: skip
        for label, places in PHASES.items():
            for owner, name in places:
                target = owners.get(owner)
                if target is not None and hasattr(target, name):
                    setattr(target, name, watch.wrap(label, getattr(target, name)))


def _engine_api():
    """(Engine, BucketSpec, CompileConfig) of the fvgraph on the path: this layout (and the one before
    the contract package, which kept these two modules where they are), or the flat one before fvgraph/
    had subpackages (a worker on an older commit imports through here too)."""
    import fvgraph
    from fvgraph import Engine

    if (Path(fvgraph.__file__).parent / "runtime").is_dir():
        from fvgraph.compile.compiler import CompileConfig
        from fvgraph.runtime.buckets import BucketSpec
    else:
        from fvgraph.buckets import BucketSpec
        from fvgraph.compiler import CompileConfig
    return Engine, BucketSpec, CompileConfig


class Bench:
    """One engine serving the mix, warm, instrumented; `run()` times the mix once."""

    def __init__(self, args: argparse.Namespace, backend: str, device: torch.device):
        Engine, BucketSpec, CompileConfig = _engine_api()
        self.args, self.device = args, device
        self.engine = Engine.from_card(
            args.card, device=device, opt_level=2 if args.gpu else 1,
            compile_config=CompileConfig(backend=backend), buckets=BucketSpec(batch_sizes=tuple(args.batch_sizes)),
        )  # fmt: skip
        facts = getattr(self.engine, "facts", None)  # older commits: the card's shapes held the text width
        self.text_dim = facts.text_dim if facts is not None else self.engine.card.shapes.text_dim
        self.engine.warmup(self.mix()[:1])
        self.engine.generate(self.mix())  # every lane's buffers exist before timing
        self.watch = Stopwatch()
        instrument(self.engine, self.watch, getattr(args, "phases", False))

    def mix(self, preview_every: int | None = None) -> list:
        return request_mix(self.args.requests, self.args.steps, self.engine.card.shapes.text_len, self.text_dim,
                           preview_every=preview_every)  # fmt: skip

    def run(self, preview_every: int | None = None) -> dict:
        """One timed mix; with `preview_every` every request asks for previews, delivered to a list."""
        requests = self.mix(preview_every)  # built before the clock starts: making the mix is the caller's work
        previews: list = []
        delivery = {} if preview_every is None else {"on_preview": previews.append}
        self.watch.seconds.clear()
        before = self.engine.counters.snapshot()
        sync(self.device)
        began = time.perf_counter()
        results = self.engine.generate(requests, **delivery)
        sync(self.device)
        wall = time.perf_counter() - began
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        done = self.engine.counters.since(before)
        seconds = self.watch.seconds
        outside = wall - sum(seconds[label] for label in SUBTRACTED)
        run = dict(batches=done["batches"], request_steps=done["compiled_steps"], outside=outside,
                   step=seconds["step"], prologue=seconds["prologue"], prologue_runs=done.get("prologue_runs"),
                   start=seconds["start"], row_copies=seconds["row_copies"],
                   rows_copied=done.get("hoisted_rows_copied"), previews=len(previews))  # fmt: skip
        if self.args.phases:
            run["phases"] = {label: seconds[label] for label in (*PHASES, "row_copies")}
            run["phases"]["other"] = outside - sum(run["phases"].values())
        return run


def stand_in(args: argparse.Namespace, backend: str, device: torch.device) -> None:
    """--stand-in: the mix with the real step, warm and evict (perf/stand_in_step.py), interleaved."""
    bench = Bench(args, backend, device)
    step = stand_in_wiring(bench)
    bench.run()  # untimed: every bucket's outputs recorded from a real run
    modes = tuple(args.stand_in) or stand_in_step.MODES
    if args.preview_every is not None:
        return previews_ab(args, bench, step, modes, backend, device)
    runs = {mode: [] for mode in modes}
    for r in range(args.repeats):
        for mode in modes[r % len(modes):] + modes[: r % len(modes)]:
            step.mode = mode
            bench.run()  # untimed: the run after a switch frees what the last mode allocated (hoisted values, outputs)
            runs[mode].append(bench.run())
    per_batch = {mode: [run["outside"] / run["batches"] for run in mode_runs] for mode, mode_runs in runs.items()}
    emit({
        **provenance("scheduler_overhead_stand_in", device), "card": args.card, "opt_level": bench.engine.opt_level,
        "backend": backend, "requests": args.requests, "batch_sizes": args.batch_sizes,
        **{mode: figures(runs[mode], args.requests) for mode in modes},
        **{f"{mode}_over_step": paired_ratio(per_batch[mode], per_batch["step"]) for mode in modes if "step" in modes and mode != "step"},
    })  # fmt: skip


def previews_ab(args: argparse.Namespace, bench: Bench, step, modes: tuple, backend: str, device: torch.device) -> None:
    """--preview-every K with --stand-in: per mode, the mix without previews and with every request
    asking for them, interleaved (order alternating); the host cost of previews is the paired
    difference of the time outside the step, per request-step and per preview delivered."""
    runs = {(mode, k): [] for mode in modes for k in (None, args.preview_every)}
    for r in range(args.repeats):
        for mode in modes:
            step.mode = mode
            for k in ((None, args.preview_every) if r % 2 == 0 else (args.preview_every, None)):
                bench.run(k)  # untimed: the run after a switch frees what the last one allocated
                runs[(mode, k)].append(bench.run(k))
    line = {**provenance("scheduler_overhead_previews", device), "card": args.card, "opt_level": bench.engine.opt_level,
            "backend": backend, "requests": args.requests, "batch_sizes": args.batch_sizes, "preview_every": args.preview_every}  # fmt: skip
    for mode in modes:
        off, on = runs[(mode, None)], runs[(mode, args.preview_every)]
        line[mode] = figures(off, args.requests)
        line[f"{mode}_previews"] = {**figures(on, args.requests), "previews": on[0]["previews"]}
        extra = [b["outside"] - a["outside"] for a, b in zip(off, on)]  # paired by round
        line[f"{mode}_preview_cost"] = {
            "us_per_request_step": spread([e / on[0]["request_steps"] for e in extra], 1e6, 2),
            "us_per_preview": spread([e / on[0]["previews"] for e in extra], 1e6, 1),
        }
    emit(line)


def stand_in_wiring(bench: Bench) -> stand_in_step.StandInStep:
    """The step, the prologues and the device copies of `bench`'s engine routed through a StandInStep
    (in its "step" mode: everything runs until the mode is switched), inside the stopwatch's labels."""
    runner = bench.engine.executor.runner
    step = stand_in_step.StandInStep(runner._replay)  # the stopwatch's "step": both are subtracted
    runner._replay = bench.watch.wrap("step", step)
    for entry in runner._graphs.values():  # inside the stopwatch's "prologue" wrapper: subtracted either way
        prologue = getattr(entry.compiled.prologue_fn, "__wrapped__", None)
        if prologue is not None:
            entry.compiled.prologue_fn = bench.watch.wrap("prologue", stand_in_step.StandInPrologue(prologue, step))
    copy_hoisted = getattr(runner._copy_hoisted, "__wrapped__", None)
    if copy_hoisted is not None:
        runner._copy_hoisted = bench.watch.wrap("row_copies", stand_in_step.skip_in_host_mode(copy_hoisted, step, runner.counters))
    if hasattr(runner, "_copy_prologue_constants"):
        runner._copy_prologue_constants = stand_in_step.skip_in_host_mode(runner._copy_prologue_constants, step)
    return step


def figures(runs: list[dict], requests: int) -> dict:
    us = lambda what, per: spread([run[what] / run[per] for run in runs], 1e6, 1)  # noqa: E731
    per_batch = runs[0]["request_steps"] / runs[0]["batches"]
    return {"batches": runs[0]["batches"], "request_steps": runs[0]["request_steps"],
            "target_us_per_batch": round(TARGET_US_PER_BATCH + TARGET_US_PER_REQUEST * per_batch, 1),
            "overhead_us_per_batch": us("outside", "batches"), "overhead_us_per_request_step": us("outside", "request_steps"),
            "step_us_per_batch": us("step", "batches"), "prologue_us_per_batch": us("prologue", "batches"),
            "prologue_runs": runs[0]["prologue_runs"], "start_us_per_request": spread([r["start"] / requests for r in runs], 1e6, 1),
            "row_copies_us_per_batch": us("row_copies", "batches"), "hoisted_rows_copied": runs[0]["rows_copied"],
            "overhead_less_row_copies_us_per_batch": spread([(r["outside"] - r["row_copies"]) / r["batches"] for r in runs], 1e6, 1),
            **phase_figures(runs)}  # fmt: skip


def phase_figures(runs: list[dict]) -> dict:
    """With --phases: each phase's us per batch. The wrappers cost about a microsecond per call, which
    that run's overhead includes: the headline overhead comes from a run without --phases."""
    if "phases" not in runs[0]:
        return {}
    per_batch = lambda label: spread([run["phases"][label] / run["batches"] for run in runs], 1e6, 1)  # noqa: E731
    return {"phases_us_per_batch": {label: per_batch(label) for label in runs[0]["phases"]}}


def worker(args: argparse.Namespace, backend: str, device: torch.device) -> None:
    """Answer one JSON line per stdin command ("run"), on the fvgraph first on PYTHONPATH."""
    try:
        commit_tree.isolate(Path(args.worker_root))
        bench = Bench(args, backend, device)
        mixed = commit_tree.foreign_modules(Path(args.worker_root))
        if mixed:
            raise RuntimeError(f"fvgraph modules from outside {args.worker_root}: {', '.join(mixed[:3])}")
        mode = "step"
        if args.stand_in is not None:  # host mode: every bucket's outputs recorded from a real run, then stood in for
            step = stand_in_wiring(bench)
            bench.run()
            mode = step.mode = "host"
            bench.run()  # untimed: the run after the switch frees what the real runs allocated
        emit({"ready": True, "engine_module": type(bench.engine).__module__, "mode": mode})
        for command in sys.stdin:
            if command.strip() != "run":
                raise RuntimeError(f"unknown command {command.strip()!r} (expected 'run')")
            emit(bench.run())
    except Exception as err:  # the driver reads it as this side's failure
        emit({"error": f"{type(err).__name__}: {err}"})
        raise SystemExit(1) from None


def against_commit(args: argparse.Namespace, device: torch.device, backend: str) -> None:
    """Both trees warm in worker processes, then `--repeats` rounds of one run each, order alternating."""
    import tempfile

    sha = commit_tree.resolve_commit(args.against_commit)
    forwarded = ["--card", args.card, "--requests", str(args.requests), "--steps", str(args.steps), "--backend", backend,
                 "--batch-sizes", *map(str, args.batch_sizes), *(["--gpu"] if args.gpu else []),
                 *(["--phases"] if args.phases else []), *(["--stand-in"] if args.stand_in is not None else [])]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="fvgraph-ab-") as tmp:
        trees = {"base": commit_tree.materialize(sha, Path(tmp)), "this": commit_tree.REPO}
        workers, engines = {}, {}
        try:
            for side, root in trees.items():  # one at a time: their compiles do not overlap
                workers[side] = commit_tree.Worker(side, root, Path(__file__).resolve(), forwarded)
                ready = workers[side].read()
                engines[side] = {"engine_module": ready["engine_module"], "mode": ready["mode"]}
            runs = {side: [] for side in trees}
            for r in range(args.repeats):
                for side in (("base", "this") if r % 2 == 0 else ("this", "base")):
                    runs[side].append(workers[side].ask("run"))
        finally:
            for w in workers.values():
                w.close()
    per_batch = {side: [run["outside"] / run["batches"] for run in side_runs] for side, side_runs in runs.items()}
    emit({
        **provenance("scheduler_overhead_ab", device), "card": args.card, "opt_level": 2 if args.gpu else 1,
        "backend": backend, "requests": args.requests, "batch_sizes": args.batch_sizes, "base_commit": sha,
        "base": {**engines["base"], **figures(runs["base"], args.requests)},
        "this": {**engines["this"], **figures(runs["this"], args.requests)},
        "overhead_ratio_this_over_base": paired_ratio(per_batch["this"], per_batch["base"])
    })  # fmt: skip


def idle(args: argparse.Namespace, device: torch.device) -> None:
    """--idle: one line per bucket (perf/replay_idle.py)."""
    args.idle_shape = args.idle_shape or ("256x256x17" if args.gpu else "32x32x1")
    height, width, frames = (int(v) for v in args.idle_shape.split("x"))

    def mix(n: int, engine) -> list:
        from fvgraph.request import Request

        g = torch.Generator().manual_seed(0)
        embeds = lambda: torch.randn(engine.card.shapes.text_len, engine.facts.text_dim, generator=g)  # noqa: E731
        return [Request(prompt_embeds=embeds(), negative_prompt_embeds=embeds(), seed=i, guidance_scale=3.0 + i % 4,
                        num_inference_steps=args.steps, num_frames=frames, height=height, width=width, output_type="latent")
                for i in range(n)]  # fmt: skip

    for bucket in args.idle_buckets:
        emit(replay_idle.idle_line(args, bucket, device, _engine_api(), method, mix))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--card", help="the card whose step the engine serves (default: wan-cpu-bench; with --idle --gpu "
                                       f"{method.GPU_CARD})")  # fmt: skip
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of the mix (per side with --against-commit)")
    parser.add_argument("--gpu", action="store_true", help="run on CUDA at -O2 (graph replays)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="the engine's batch buckets")
    parser.add_argument("--backend", choices=("inductor", "aot_eager", "eager"),
                        help="the step's compile backend, timed apart either way (default: inductor on CPU, "
                             "aot_eager on a GPU, where a replay costs the same whatever compiled it)")  # fmt: skip
    parser.add_argument("--against-commit", metavar="SHA", help="also run the mix on this commit's tree, interleaved (A/B)")
    parser.add_argument("--phases", action="store_true",
                        help="also time the overhead by phase (scheduling, next(), static inputs, hoisted rows, scatter, "
                             "host outputs, finite check, advance, other), in us per batch")  # fmt: skip
    parser.add_argument("--stand-in", nargs="*", choices=stand_in_step.MODES, metavar="MODE",
                        help="also time the mix with the step stood in for by its recorded outputs, caches warm and "
                             "evicted (perf/stand_in_step.py), interleaved with the real step; given modes, those "
                             f"alone (of {', '.join(stand_in_step.MODES)}); with --against-commit, both trees in host mode")  # fmt: skip
    parser.add_argument("--preview-every", type=int, metavar="K",
                        help="with --stand-in: also the mix with every request asking for previews every K steps, interleaved (A/B)")
    parser.add_argument("--idle", action="store_true", help="device idle time between replays, serial vs run-ahead, per bucket")
    parser.add_argument("--idle-buckets", type=int, nargs="+", default=[1, 4, 8], help="with --idle: one engine per bucket")
    parser.add_argument("--idle-shape", help="with --idle: HxWxF (default 256x256x17 with --gpu, else 32x32x1)")
    parser.add_argument("--idle-backend", default="inductor", choices=("inductor", "aot_eager"), help="with --idle: the step's backend")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-root", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats={args.repeats} must be >= 1")
    backend = args.backend or ("aot_eager" if args.gpu else "inductor")
    device = torch.device("cuda" if args.gpu else "cpu")
    args.card = args.card or (method.GPU_CARD if args.idle and args.gpu else "wan-cpu-bench")
    if args.preview_every is not None and (args.stand_in is None or args.against_commit or args.idle):
        raise SystemExit("--preview-every runs with --stand-in on this tree alone (not with --against-commit or --idle)")
    if args.idle:
        return idle(args, device)
    if args.worker:
        return worker(args, backend, device)
    if args.against_commit:
        if args.stand_in not in (None, [], ["host"]):
            raise SystemExit(f"--stand-in {' '.join(args.stand_in)}: with --against-commit both trees run in host mode alone")
        return against_commit(args, device, backend)
    if args.stand_in is not None:
        return stand_in(args, backend, device)
    bench = Bench(args, backend, device)
    runs = [bench.run() for _ in range(args.repeats)]
    emit({
        **provenance("scheduler_overhead", device), "card": args.card, "opt_level": bench.engine.opt_level,
        "backend": backend, "requests": args.requests, **figures(runs, args.requests),
        "replays": bench.engine.counters.replays,
    })  # fmt: skip


if __name__ == "__main__":
    main()
