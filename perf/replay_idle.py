"""Device idle time between consecutive step replays, serial order against running ahead.

    python perf/bench_scheduler_overhead.py --idle --gpu                  # Wan 1.3B config, 256x256x17, -O2, buckets 1 4 8
    python perf/bench_scheduler_overhead.py --idle --idle-buckets 1 2     # the CPU analogue: wan-cpu-bench, 32x32x1, -O1

For each batch bucket B an engine with that one bucket serves B requests at once (one group per tick,
the case where the next batch holds the same requests as the one before), once serially and once
running ahead (fvgraph/engine/run_ahead.py: the next batch is launched before the last one is
read back), alternating over `--repeats` rounds on the same warm
engine. Every replay of the step is bracketed by two CUDA events (on the CPU, clock reads around the
compiled call); the idle time is the time from one replay's end to the next one's start, summed,
as a fraction of the summed replay time. On the CPU the step runs on the host itself, so nothing can
overlap and both orders show the host's own gap: that run only rehearses the code path.
"""

from __future__ import annotations

import time

import torch


class ReplaySpans:
    """The start and end of every step replay the wrapped callable makes, on the device's clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple] = []

    def wrap(self, fn):
        def timed(*args):
            start = self._mark()
            out = fn(*args)
            self.spans.append((start, self._mark()))
            return out

        return timed

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def idle(self) -> dict:
        """Call after a device sync: replays, summed replay ms, summed gap ms, and their ratio."""
        busy = sum(self._ms(s, e) for s, e in self.spans)
        gaps = [self._ms(self.spans[i][1], self.spans[i + 1][0]) for i in range(len(self.spans) - 1)]
        return {"replays": len(self.spans), "step_ms": busy / len(self.spans), "gap_us": 1e3 * sum(gaps) / max(len(gaps), 1),
                "idle_fraction": sum(gaps) / busy}  # fmt: skip


def idle_line(args, bucket: int, device: torch.device, engine_api, method, mix) -> dict:
    """One bucket's line: both orders' idle fraction, gap and step time, each over the rounds."""
    Engine, BucketSpec, CompileConfig = engine_api
    engine = Engine.from_card(args.card, device=device, opt_level=2 if device.type == "cuda" else 1,
                              compile_config=CompileConfig(backend=args.idle_backend), text_encoder=False,
                              buckets=BucketSpec(batch_sizes=(bucket,)), max_running=bucket)  # fmt: skip
    requests = lambda: mix(bucket, engine)  # noqa: E731
    engine.warmup(requests()[:1])
    spans = ReplaySpans(device)
    runner = engine.executor.runner
    runner._replay = spans.wrap(runner._replay)
    samples = {"serial": [], "ahead": []}
    for r in range(args.repeats + 1):  # the first round of each order is untimed
        for order in (("serial", "ahead") if r % 2 == 0 else ("ahead", "serial")):
            engine.run_ahead = order == "ahead"
            spans.spans.clear()
            before = engine.counters.snapshot()
            results = engine.generate(requests())
            method.sync(device)
            assert all(x.ok for x in results), [x.error for x in results if not x.ok]
            if r > 0:
                samples[order].append({**spans.idle(), "redone": engine.counters.since(before).get("batches_redone", 0)})
    figures = {order: {key: method.spread([s[key] for s in runs], 100 if key == "idle_fraction" else 1, 3)
                       for key in ("idle_fraction", "gap_us", "step_ms")} for order, runs in samples.items()}  # fmt: skip
    for order in figures:
        figures[order]["idle_percent"] = figures[order].pop("idle_fraction")
        figures[order]["batches_redone"] = sum(run["redone"] for run in samples[order])  # early launches dropped
    return {**method.provenance("replay_idle", device), "card": args.card, "shape": args.idle_shape, "bucket": bucket,
            "opt_level": engine.opt_level, "backend": args.idle_backend, "requests": bucket, "steps": args.steps,
            "replays_per_run": samples["serial"][0]["replays"], **figures, "target_idle_percent": 5}  # fmt: skip
