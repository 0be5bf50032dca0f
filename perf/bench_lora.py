"""Per denoise step with LoRA adapters, interleaved in one process (fvgraph.perf.method): fvgraph's slot
path at each adapter rank against the same engine without adapters, beside (unless --no-references)
the adapter merged into the weights and diffusers eager with the adapter loaded by peft (unmerged, as
`load_lora_weights` leaves it).

    python perf/bench_lora.py --batch 4 --no-references   # wan-cpu-bench on the CPU, -O1, ranks 32 and 128
    python perf/bench_lora.py --gpu --batch 4             # Wan 1.3B config, bf16, 480x832x33

Cases per rank R (the adapter is a random LoRA of rank R on every attention projection and FFN linear,
written by peft and read through diffusers' loader), each a batch of `--batch` requests:

    fvgraph_base              no adapter slots at all (the step without any LoRA machinery)
    fvgraph_slots_rR_unused   an engine with slots of rank R (4 slots, 2 per request), no row choosing an adapter
    fvgraph_slots_rR          the same engine, every row choosing the adapter at scale 1
    fvgraph_slots_rR_one      the same engine, the first row choosing it and the others none (batch > 1)
    fvgraph_merged_rR         the adapter fused into the weights (what --merge-lora serves)
    diffusers_peft_rR         diffusers eager with the adapter loaded by peft

Prints one JSON line: per-step ms (min / median / max over the rounds) per case; per round the ratio
of each slot case to fvgraph_base (and to the merged case); and per rank the low-rank share of the
step's FLOPs: (FLOPs of the step with every row choosing the adapter - FLOPs without) / FLOPs
without, counted by torch's flop counter on a data-free twin of the denoiser with the same slots.
The bar the slot path is held to with every row choosing the adapter is 1 + 1.5 x that share.

On the CPU torch runs on one thread unless `--threads` says otherwise: on a CPU other jobs share,
torch's pool of one thread per core spends each parallel region (every op) waiting for a worker the
scheduler has taken off its core, so a step's wall time follows its count of ops, not its work, and
the slot step (more ops, few more FLOPs) measured ~2x the base step at every rank and row count
(docs/adapters.md, "Measured cost").
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from diffusers import WanPipeline
from peft import LoraConfig, get_peft_model_state_dict

from fvgraph.adapters.slots import ROW_INPUTS, LoraSlots, install_slots
from fvgraph.contract.flops import flop_counter
from fvgraph.loops.step_flops import meta_twin
from fvgraph.compile.compiler import CompileConfig
from fvgraph.engine.engine import Engine
from fvgraph.perf.bench_step import GUIDANCE, fvgraph_case
from fvgraph.perf.method import Case
from fvgraph.perf.diffusers_baselines import diffusers_step_case, untouched_components
from fvgraph.perf.method import add_workload_options, emit, interleaved, paired_ratio, provenance, spread, workload
from fvgraph.models.components import diffusers_scheduler
from fvgraph.request import Request
from fvgraph.runtime.buckets import BucketSpec

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


def random_lora(card: str, device: torch.device, rank: int, folder: Path) -> Path:
    """A random rank-`rank` LoRA on TARGETS, written by diffusers' save_lora_weights (peft's config as metadata)."""
    transformer = untouched_components(card, torch.device("cpu")).transformer
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False)
    torch.manual_seed(rank)
    transformer.add_adapter(config, adapter_name="bench")
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.02)
    WanPipeline.save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(transformer, adapter_name="bench"),
                                  weight_name=f"r{rank}.safetensors", transformer_lora_adapter_metadata=config.to_dict())  # fmt: skip
    return folder / f"r{rank}.safetensors"


def low_rank_share(engine: Engine, request: Request, batch: int, slots: LoraSlots) -> float:
    """The adapter's share of the step's FLOPs: the step on a data-free twin of the denoiser whose
    TARGETS linears have these slots, every row choosing slot 0 at scale 1 (one place), against the same
    step without rows. (The engine's slot path runs every linear's slots; the adapter adapts TARGETS.)"""
    twin = meta_twin(engine.loop.components.transformer)
    install_slots(twin, slots)
    for name, module in twin.named_modules():
        if "forward" in module.__dict__ and not name.endswith(tuple(TARGETS)):
            del module.forward  # the base linear alone: no adapter reaches it
    state = engine.loop.init(request.resolve(engine.card, engine.facts))
    plan = engine.loop.next(state)  # the first denoise step (the request brings its text embeddings)
    step = engine.loop.denoiser.step(twin, engine.loop.sampler, state.cfg, None)
    inputs = {name: t.to("meta").expand(batch, *t.shape[1:]) for name, t in plan.inputs.items() if name not in ROW_INPUTS}
    rows = {"lora_index": torch.zeros(batch, 1, dtype=torch.long, device="meta"), "lora_scale": torch.ones(batch, 1, device="meta")}
    counts = []
    for extra in ({}, rows):
        with flop_counter() as counter, torch.no_grad():
            step(**inputs, **extra)
        counts.append(counter.get_total_flops())
    return (counts[1] - counts[0]) / counts[0]


def batch_case(name: str, engine: Engine, requests: list[Request]) -> Case:
    """fvgraph_case's run with these requests as the batch (one tick per run, admission and the last
    step untimed)."""
    state = {"left": 0, "round": 0}
    steps = requests[0].num_inference_steps

    def before():
        if state["left"] > 0:
            return
        while engine.has_work():
            for result in engine.tick():
                assert result.ok, result.error
        state["round"] += 1
        for i, request in enumerate(requests):
            engine.submit(request.model_copy(update={"seed": i, "request_id": f"{name}-{state['round']}-{i}"}))
        engine.tick()
        state["left"] = steps - 2

    def run():
        done = engine.tick()
        assert not done, [r.error for r in done]
        state["left"] -= 1

    return Case(name, run, before)


def bench(card: str, device: torch.device, shape: tuple[int, int, int], ranks: tuple[int, ...], level: int, batch: int,
          repeats: int, warmup: int, references: bool) -> dict:  # fmt: skip
    height, width, frames = shape
    steps = min(warmup + repeats + 2, 50)
    folder = Path(tempfile.mkdtemp(prefix="fvgraph-bench-lora-"))
    files = {r: random_lora(card, device, r, folder) for r in ranks}
    common = dict(device=device, opt_level=level, buckets=BucketSpec(batch_sizes=(batch,)),
                  compile_config=CompileConfig(backend="inductor"))
    base = Engine.from_card(card, **common)
    g = torch.Generator().manual_seed(0)
    pe, ne = (torch.randn(base.card.shapes.text_len, base.facts.text_dim, generator=g) for _ in range(2))
    request = Request(prompt_embeds=pe, negative_prompt_embeds=ne, guidance_scale=GUIDANCE, height=height, width=width,
                      num_frames=frames, seed=0, num_inference_steps=steps, output_type="latent")  # fmt: skip
    cases = [fvgraph_case("fvgraph_base", base, request, batch)]
    latents = torch.cat([base.loop.init(request.resolve(base.card, base.facts).model_copy(update={"seed": i})).latents
                         for i in range(batch)])  # fmt: skip
    dtype = base.loop.components.transformer.dtype
    shares = {}
    for r in ranks:
        # one engine per case: a case drains its engine between batches, which would end another's requests
        slots = LoraSlots(4, r, 2)
        adapted = request.model_copy(update={"loras": {"x": 1.0}})
        engines = {k: Engine.from_card(card, loras={"x": files[r]}, lora_slots=slots, **common) for k in ("unused", "all", "one")}
        shares[f"r{r}"] = round(low_rank_share(engines["all"], request, batch, slots), 4)
        cases += [fvgraph_case(f"fvgraph_slots_r{r}_unused", engines["unused"], request, batch),
                  fvgraph_case(f"fvgraph_slots_r{r}", engines["all"], adapted, batch)]
        if batch > 1:
            cases.append(batch_case(f"fvgraph_slots_r{r}_one", engines["one"], [adapted] + [request] * (batch - 1)))
        if not references:
            continue
        merged = Engine.from_card(card, loras={"x": files[r]}, merge_loras={"x": 1.0}, **common)
        cases.append(fvgraph_case(f"fvgraph_merged_r{r}", merged, adapted, batch))
        c = untouched_components(card, device)
        pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, transformer=c.transformer,
                           scheduler=diffusers_scheduler(base.card.recipe.sampler))  # fmt: skip
        pipe.load_lora_weights(str(files[r]), adapter_name="x")
        cases.append(diffusers_step_case(f"diffusers_peft_r{r}", pipe.transformer, base.card.recipe.sampler, latents,
                                         pe[None].to(device, dtype), ne[None].to(device, dtype), GUIDANCE, steps))  # fmt: skip
    samples, warm = interleaved(cases, repeats, warmup, device)
    ratios = {f"{case}_vs_base": paired_ratio(samples[case], samples["fvgraph_base"])
              for case in samples if case.startswith(("fvgraph_slots", "fvgraph_merged"))}  # fmt: skip
    for r in ranks if references else ():
        ratios[f"fvgraph_slots_r{r}_vs_merged"] = paired_ratio(samples[f"fvgraph_slots_r{r}"], samples[f"fvgraph_merged_r{r}"])
        ratios[f"diffusers_peft_r{r}_vs_fvgraph_slots"] = paired_ratio(samples[f"diffusers_peft_r{r}"], samples[f"fvgraph_slots_r{r}"])
    return {
        **provenance("lora", device), "card": card, "opt_level": level, "batch": batch, "ranks": list(ranks),
        "shape": {"height": height, "width": width, "frames": frames}, "dtype": str(dtype).removeprefix("torch."),
        "per_step_ms": {name: spread(s, 1e3) for name, s in samples.items()},
        "time_ratio_per_round": ratios,  # > 1: the first case is slower
        "low_rank_flop_share": shares,  # per rank; the all-rows bar is 1 + 1.5 x this
        "all_rows_bar": {k: round(1 + 1.5 * v, 4) for k, v in shares.items()},
        "warmup_s_including_compile": {k: round(v, 2) for k, v in warm.items()},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_options(parser, gpu_shape="480x832x33")
    parser.add_argument("--ranks", default="32,128", help="adapter (and slot) ranks, comma separated")
    parser.add_argument("--opt-level", type=int, default=None, help="default 1 on CPU, 2 on GPU")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 8 CPU, 20 GPU)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-references", action="store_true", help="skip the merged and diffusers + peft cases")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default 1 on the CPU, torch's own on GPU)")
    args = parser.parse_args(argv)
    card, device, shape = workload(args)
    threads = args.threads if args.threads is not None else (None if args.gpu else 1)
    if threads is not None:
        if threads < 1:
            raise SystemExit(f"--threads={threads} must be >= 1")
        torch.set_num_threads(threads)  # the result line's machine.torch_threads records it
    level = args.opt_level if args.opt_level is not None else (2 if args.gpu else 1)
    ranks = tuple(int(v) for v in args.ranks.split(","))
    emit(bench(card, device, shape, ranks, level, args.batch, args.repeats or (20 if args.gpu else 8), args.warmup, not args.no_references))


if __name__ == "__main__":
    main()
