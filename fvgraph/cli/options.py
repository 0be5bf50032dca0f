"""What several commands share: building the engine from the common options, the compile config,
and checks of paths and shapes that fail before any work (a bad option must not cost the run)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

console = Console()
DEFAULT_CACHE_DIR = Path("capture_cache")

# One -O default for generate, serve, parity and warmup: -O1, compiled and batched steps, the level that
# runs the same on a CPU and a GPU (warmup needs a compiling level; -O2's CUDA graphs exist on a GPU only).
# The first call of a shape pays the compile; -O0 starts at once (`make demo` runs it).
DEFAULT_OPT_LEVEL = 1
OPT_LEVEL_HELP = "0 eager, 1 compiled + batched steps, 2 + CUDA graphs (GPU), 3 + FP8 kernels."


def opt_level_option(help: str = OPT_LEVEL_HELP):
    return typer.Option(DEFAULT_OPT_LEVEL, "-O", "--opt-level", help=help)


def cuda_graphs_note(opt_level: int, device: Optional[str], cuda_graphs: bool = True) -> Optional[str]:
    """The one line a run at -O2 or -O3 on a CPU prints: its CUDA graphs apply only on a GPU."""
    import torch

    from fvgraph.runtime.opt_levels import OPT_LEVELS

    level = OPT_LEVELS.get(opt_level)
    on_cpu = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type != "cuda"
    if level is None or not level.cuda_graphs or not cuda_graphs or not on_cpu:
        return None
    return f"note: -O{opt_level}'s CUDA graphs apply only on a GPU; on a CPU the compiled steps run without them"

# The run's precision and recipe over the card's (fvgraph/card_choices.py), shared by generate, serve and env.
DTYPE_OPTION = typer.Option(None, "--dtype", help="fp32 | bf16 | fp16: the denoiser and text encoder's dtype (default: the card's precision).")
FLOW_SHIFT_OPTION = typer.Option(None, "--flow-shift", help="The sampler's flow_shift (default: the card's; a checkpoint that says otherwise is warned about).")
BOUNDARY_RATIO_OPTION = typer.Option(None, "--boundary-ratio", help="Two-expert cards: where the low-noise expert takes over (default: the card's).")

# Step caching at deploy scope (docs/serving.md), shared by generate, serve and serve-ray.
CACHE_METHODS_OPTION = typer.Option(None, "--cache-methods", help="Step-caching methods requests may pick, comma separated "
                                    "(e.g. magcache,fbcache); 'none': exact execution only (default: all).")  # fmt: skip


def parse_cache_methods(text: Optional[str]) -> Optional[tuple[str, ...]]:
    """Engine.from_card's cache_methods from --cache-methods: None (all) when not given, () for 'none';
    ValueError naming the flag."""
    from fvgraph.caching.methods import enabled_methods

    if text is None:
        return None
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if names == ("none",):
        return ()
    if not names:
        raise ValueError(f"--cache-methods={text!r} must be method names, comma separated, or 'none'")
    try:
        return enabled_methods(names)
    except ValueError as err:
        raise ValueError(f"--cache-methods={text!r}: {err}") from None


# LoRA adapters (docs/adapters.md), shared by generate, serve, warmup and parity.
LORA_OPTION = typer.Option([], "--lora", help="NAME=PATH[@EXPERT]: load a local LoRA file as adapter NAME (repeatable); requests choose it "
                           "by name. On a two-expert card, @transformer_2 loads it into the low-noise expert (default @transformer).")
MERGE_LORA_OPTION = typer.Option([], "--merge-lora", help="NAME=SCALE: fuse --lora NAME into the weights at SCALE instead of a slot (repeatable).")
MAX_LORAS_OPTION = typer.Option(None, "--max-loras", help="Adapter slots (default 4 when an adapter needs one).")
MAX_LORA_RANK_OPTION = typer.Option(None, "--max-lora-rank", help="Every slot's rank (default 64); a higher-rank adapter is refused.")
LORA_TARGET_MODULES_OPTION = typer.Option(None, "--lora-target-modules", help="NAME,NAME,...: only these linears get adapter slots (peft's matching: "
                                                                              "to_q is every block's to_q); default every linear. An adapter with factors elsewhere is refused.")


def adapter_options(lora: list[str], merge_lora: list[str], max_loras: Optional[int], max_lora_rank: Optional[int],
                    target_modules: Optional[str] = None) -> dict:  # fmt: skip
    """Engine.from_card's loras / merge_loras / lora_slots from the flags; ValueError naming the flag."""
    from fvgraph.adapters.slots import LoraSlots

    loras = {name: _lora_file(name, value) for name, value in _pairs(lora, "--lora", "NAME=PATH[@EXPERT]").items()}
    merge = {}
    for name, text in _pairs(merge_lora, "--merge-lora", "NAME=SCALE").items():
        try:
            merge[name] = float(text)
        except ValueError:
            raise ValueError(f"--merge-lora {name}={text!r}: the scale must be a number") from None
        if not math.isfinite(merge[name]) or abs(merge[name]) > 100:  # the rule a request's scale follows
            raise ValueError(f"--merge-lora {name}={text}: the scale must be a finite number in [-100, 100]")
    slots = None
    if max_loras is not None or max_lora_rank is not None or target_modules is not None:
        targets = None if target_modules is None else [t.strip() for t in target_modules.split(",")]
        try:
            slots = LoraSlots(**{k: v for k, v in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)) if v is not None},
                              max_loras_per_request=min(2, max_loras or 2), target_modules=targets)  # fmt: skip
        except ValueError as err:
            raise ValueError(f"--max-loras / --max-lora-rank / --lora-target-modules: {err}") from None
    return {"loras": loras or None, "merge_loras": merge or None, "lora_slots": slots}


def _lora_file(name: str, value: str):
    """--lora's PATH, or a LoraFile for PATH@EXPERT: the text after the last '@' is an expert when it
    holds no '/' or '.' (so a file named 'v@2.safetensors' stays a path)."""
    from fvgraph.adapters.registry import EXPERTS
    from fvgraph.adapters.setup import LoraFile

    path, at, suffix = value.rpartition("@")
    if not at or "/" in suffix or "." in suffix:
        return Path(value)
    if suffix not in EXPERTS or not path:
        raise ValueError(f"--lora {name}={value!r}: the suffix @{suffix} must be @transformer (the high-noise or only "
                         "denoiser) or @transformer_2 (a two-expert card's low-noise expert), after a PATH")  # fmt: skip
    return LoraFile(Path(path), expert=suffix)


def _pairs(items: list[str], option: str, form: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{option}={item!r} must be {form}")
        if name in pairs:
            raise ValueError(f"{option}: adapter {name!r} given twice")
        pairs[name] = value
    return pairs


def chosen_card_from_options(card, dtype: Optional[str], flow_shift: Optional[float], boundary_ratio: Optional[float]):
    """The card with --dtype, --flow-shift and --boundary-ratio applied; ValueError naming the flag."""
    from fvgraph.card_choices import with_dtype, with_recipe

    if dtype is not None:
        try:
            card = with_dtype(card, dtype)
        except ValueError as err:
            raise ValueError(f"--dtype: {err}") from None
    for flag, key, value in (("--flow-shift", "flow_shift", flow_shift), ("--boundary-ratio", "boundary_ratio", boundary_ratio)):
        if value is not None:
            try:
                card = with_recipe(card, {key: value})
            except ValueError as err:
                raise ValueError(f"{flag}: {err}") from None
    return card


def card_with_cache(card, cache: Optional[str]):
    """The card (a name or a ModelCard), its `default_cache` replaced by `--cache` when given (the same
    errors as Request(cache=...))."""
    from fvgraph.cards import get_card
    from fvgraph.caching.methods import parse_cache_settings

    model = get_card(card) if isinstance(card, str) else card
    if cache is None:
        return model
    try:
        settings = parse_cache_settings(cache)
    except ValueError as err:
        raise ValueError(f"--cache: {err}") from None
    return model.model_copy(update={"default_cache": settings})


ARTIFACT_FORMAT_OPTION = typer.Option("auto", "--artifact-format", help="How the capture cache stores inductor steps: "
                                      "standalone (inductor's standalone artifact), aoti (AOTInductor packages) or auto "
                                      "(standalone on a GPU, aoti on a CPU); docs/capture_cache.md.")


def compile_config(compile_backend: str, disable_pass: list[str], compile_steps: str = "loop", artifact_format: str = "auto"):
    from fvgraph.compile.compiler import CompileConfig
    from fvgraph.passes.manager import PassConfig

    if compile_backend not in ("eager", "aot_eager", "inductor"):
        raise ValueError(f"--compile-backend={compile_backend!r} must be eager, aot_eager or inductor")
    if artifact_format not in ("auto", "standalone", "aoti"):
        raise ValueError(f"--artifact-format={artifact_format!r} must be auto, standalone or aoti")
    kinds = tuple(name.strip() for name in compile_steps.split(",") if name.strip())
    if not kinds:
        raise ValueError(f"--compile-steps={compile_steps!r} must be 'loop', 'all' or step kind names, comma separated")
    step_kinds = None if compile_steps == "loop" else "all" if compile_steps == "all" else kinds
    return CompileConfig(backend=compile_backend, passes=PassConfig(disabled=tuple(disable_pass)), step_kinds=step_kinds,
                         artifact_format=artifact_format)  # fmt: skip


VAE_TILING_OPTION = typer.Option(None, "--vae-tiling", help="Decode (and encode) in tiles, one step each: 'on' for diffusers' defaults, or KEY=VALUE,... of the VAE's enable_tiling (docs/memory.md).")


OFFLOAD_OPTION = typer.Option(None, "--offload", help="'components': each component (text encoder, transformer or expert, VAE) on the device only while its steps run; 'blocks:N': a Wan transformer's blocks streamed from host memory N at a time through two fixed device slots (docs/memory.md).")


def parse_vae_tiling(text: Optional[str]) -> bool | dict | None:
    """Engine.from_card's vae_tiling from --vae-tiling: None, True ('on'), or enable_tiling's keywords:
    sizes as ints, a `..._factor` (HunyuanVideo-1.5's tile_overlap_factor) as a float."""
    if text is None:
        return None
    if text.strip().lower() == "on":
        return True
    settings = {}
    for key, value in _pairs([item for item in text.split(",") if item.strip()], "--vae-tiling", "KEY=VALUE").items():
        factor = key.endswith("_factor")
        try:
            settings[key] = float(value) if factor else int(value)
        except ValueError:
            rule = "a number" if factor else "a whole number of pixels"
            raise ValueError(f"--vae-tiling {key}={value!r}: the value must be {rule}") from None
    return settings


def serving_engine(card, checkpoint: Optional[Path], opt_level: int, no_cudagraph: bool, enforce_eager: bool,
                    compile_backend: str, disable_pass: list[str], device: Optional[str], cache_dir: Optional[Path],
                    fail_on_recompile: bool, compile_steps: str = "loop", max_running: int = 16,
                    cache: Optional[str] = None, cfg_parallel: Optional[int] = None,
                    ulysses: Optional[int] = None, dtype: Optional[str] = None, flow_shift: Optional[float] = None,
                    boundary_ratio: Optional[float] = None, adapters: dict | None = None,
                    cache_methods: Optional[str] = None, vae_tiling: Optional[str] = None,
                    offload: Optional[str] = None, artifact_format: str = "auto"):  # fmt: skip
    """The engine `generate` and `serve` run, from their shared options (`card`: a name or a ModelCard,
    `checkpoint`: its local folder, `adapters`: adapter_options(), `cache_methods`: --cache-methods' text,
    `vae_tiling`: --vae-tiling's text, `offload`: --offload's)."""
    from fvgraph.caching.settings import NO_CACHE
    from fvgraph.engine.engine import Engine
    from fvgraph.parallel.config import ParallelConfig

    parallel = None
    if cfg_parallel is not None or ulysses is not None:  # either flag starts worker processes, even at degree 1
        if cfg_parallel is not None and cfg_parallel not in (1, 2):
            raise ValueError(f"--cfg-parallel={cfg_parallel} must be 1 or 2 (2 runs cond and uncond on two processes)")
        if ulysses is not None and ulysses < 1:
            raise ValueError(f"--ulysses={ulysses} must be at least 1 (the processes splitting each denoiser call)")
        try:
            parallel = ParallelConfig(cfg=1 if cfg_parallel is None else cfg_parallel,
                                      ulysses=1 if ulysses is None else ulysses)  # fmt: skip
        except ValueError as err:
            raise ValueError(f"--cfg-parallel / --ulysses: {err}") from None

    methods = parse_cache_methods(cache_methods)
    chosen = chosen_card_from_options(card_with_cache(card, cache), dtype, flow_shift, boundary_ratio)
    # --cache outside --cache-methods would be dropped in silence (a card default not enabled is not applied).
    if cache is not None and methods is not None and chosen.default_cache.method not in (*methods, NO_CACHE):
        raise ValueError(f"--cache={cache!r}: method {chosen.default_cache.method!r} is not in --cache-methods "
                         f"({', '.join(methods) or 'none'}); enable it there or leave --cache out")  # fmt: skip
    try:
        engine = Engine.from_card(
            chosen, checkpoint=checkpoint, opt_level=opt_level, device=device, enforce_eager=enforce_eager,
            compile_config=compile_config(compile_backend, disable_pass, compile_steps, artifact_format), cuda_graphs=not no_cudagraph,
            cache_dir=cache_dir, max_running=max_running, parallel=parallel, cache_methods=methods, **(adapters or {}),
            vae_tiling=parse_vae_tiling(vae_tiling), offload=offload,
        )  # fmt: skip
    except ValueError as err:  # the engine names its keyword; the command line names the flag
        for keyword, flag in (("vae_tiling", "--vae-tiling"), ("offload", "--offload")):
            if str(err).startswith(keyword):
                raise ValueError(flag + str(err).removeprefix(keyword)) from None
        raise
    if fail_on_recompile:
        engine.freeze()
    return engine


def writable_dir(folder: Path, option: str) -> None:
    """ValueError naming the option unless `folder` exists (or can be made) and takes new files."""
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".fvgraph-write-probe-"):
            pass
    except OSError as err:
        raise ValueError(f"{option}: cannot write into {folder}: {err}") from None


def bindable(host: str, port: int) -> None:
    """ValueError naming --port unless a listening socket can bind host:port now, bound as uvicorn binds
    it. Checked before the engine loads (or Ray starts), which takes a while and would then fail late."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        try:
            probe.bind((host, port))
        except OSError as err:
            raise ValueError(f"--port={port}: cannot bind {host}:{port}: {err.strerror or err}") from None


def parse_shape(text: str, option: str = "--shape") -> tuple[int, int, int]:
    """FRAMESxHEIGHTxWIDTH as three ints; ValueError naming the option."""
    try:
        frames, height, width = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"{option}={text!r} must be FRAMESxHEIGHTxWIDTH, e.g. 5x64x64") from None
    return frames, height, width


def parse_level(text: str, option: str) -> int:
    """An opt level given as text; ValueError naming the option."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{option}={text!r} must be an opt level (0-3) or 'none'") from None


def parse_size(text: str, option: str) -> int:
    """A memory size such as 60GiB, 512MiB or 2e9 (bytes): finite and positive; ValueError naming the option."""
    from fvgraph.serving.http_server import parse_bytes

    try:
        return parse_bytes(text, option)
    except OverflowError:  # inf, or a number past float range
        raise ValueError(f"{option}={text!r} must be a finite size such as 60GiB, 512MiB or 2000000000") from None


def at_least_one(value: int, option: str, what: str) -> None:
    """ValueError naming the option unless `value` >= 1."""
    if value < 1:
        raise ValueError(f"{option}={value} must be at least 1 ({what})")
