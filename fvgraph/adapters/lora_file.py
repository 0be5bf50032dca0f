"""A LoRA file read as diffusers reads it: per target linear, its low-rank factors and its scaling.

    lora = read_lora(path, pipeline_class="WanPipeline", transformer=components.transformer)
    lora.modules["blocks.0.attn1.to_q"]  # LoraModule(down [r, in], up [out, r], up_bias [out] | None, scaling)

Key formats are converted by diffusers' own `<Pipeline>.lora_state_dict` (diffusers/peft keys, and
for Wan the musubi/kohya `lora_unet_*` and original `diffusion_model.*` layouts, including LightX2V's;
for FLUX also kohya's `lora_unet_double_blocks_*` layout and peft keys with `.alpha` keys beside
them); a pipeline diffusers gives no LoRA loader (HunyuanVideo15Pipeline) is read as its denoiser's
`load_lora_adapter` reads a file: peft keys under `transformer.`, unconverted; the scaling of each module is the one peft gives it when diffusers loads the file: diffusers
builds the `LoraConfig` (the file's `lora_adapter_metadata`, its `.alpha` keys, or ranks read from
the keys) and peft resolves each module's rank and alpha from its patterns, `alpha / r`
(`alpha / sqrt(r)` with rsLoRA). Nothing here rewrites a conversion.

Every key is checked against the denoiser: a module it does not have, a module that is not a
Linear, or factors of the wrong shape are refused naming the key. Keys for other components (a
text encoder's LoRA) and DoRA magnitudes are refused too: the slots hold the denoiser's linears only.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch
from safetensors import safe_open
from torch import nn

DENOISER_PREFIX = "transformer."
MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit on the JSON header
# The largest value an adapted linear may add, bound as |scaling| * max|up| * max|down| * rank: past
# float32's range the slot's product is Inf, and a row that multiplies it by 0 gets NaN.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class AdapterError(ValueError):
    """An adapter file or an adapter operation that cannot be honoured; the message names the key or field."""


@dataclass(frozen=True)
class LoraModule:
    """One adapted linear: `y = W x + b + scaling * (up @ down) x (+ scaling * up_bias)`."""

    down: torch.Tensor  # [r, in]  (peft's lora_A)
    up: torch.Tensor  # [out, r]  (peft's lora_B)
    up_bias: torch.Tensor | None  # [out]  (lora_B's bias: diffusers' conversion of `diff_b` keys)
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])


@dataclass(frozen=True)
class LoraWeights:
    """A whole adapter for one denoiser."""

    path: str
    modules: dict[str, LoraModule]  # by module name in the denoiser, e.g. "blocks.0.attn2.to_k"
    digest: str  # sha256 over module names, factors and scalings: what caches key on

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())


def _first_key(path: Path) -> str | None:
    with safe_open(str(path), framework="pt") as f:
        return min(f.keys(), default=None)


def read_lora(path: str | Path, pipeline_class: str, transformer: nn.Module) -> LoraWeights:
    """Read and check a local LoRA file (`.safetensors`, any key format diffusers converts for this family)."""
    path = Path(path)
    check_safetensors(path)
    reader, source = _state_dict_reader(pipeline_class)
    # Families whose files may carry kohya-style `.alpha` keys (FLUX) return them apart, as network
    # alphas, when asked; diffusers' load_lora_weights then builds the LoraConfig from them.
    with_alphas = "return_alphas" in inspect.signature(reader).parameters
    try:
        loaded = reader(str(path), return_lora_metadata=True, **({"return_alphas": True} if with_alphas else {}))
    except Exception as err:  # unreadable, not safetensors, or a layout no converter knows
        # a converter's bare assert has no message; the file's first key says whose layout it is
        raise AdapterError(f"lora {str(path)!r}: diffusers' {source} cannot read it: "
                           f"{type(err).__name__}: {err} (the file's first key is {_first_key(path)!r}: an adapter for "
                           "another model family, or a layout diffusers does not convert for this one)") from None  # fmt: skip
    state_dict, alphas, metadata = loaded if with_alphas else (loaded[0], None, loaded[1])
    others = sorted(k for k in state_dict if not k.startswith(DENOISER_PREFIX))
    if others:
        raise AdapterError(f"lora key {others[0]!r} ({len(others)} such keys) is not the denoiser's: adapters apply "
                           f"to the transformer only (a text encoder's LoRA is not supported), in a layout "
                           f"{source} reads (is it an adapter for another model family?)")  # fmt: skip
    state_dict = {k.removeprefix(DENOISER_PREFIX): v for k, v in state_dict.items()}
    bad = sorted(k for k in state_dict if ".lora_A." not in k and ".lora_B." not in k)
    if bad:
        raise AdapterError(f"lora key {bad[0]!r} is neither a lora_A nor a lora_B factor (DoRA and full-weight "
                           "deltas are not supported by adapter slots)")  # fmt: skip
    metadata = {k.removeprefix(DENOISER_PREFIX): v for k, v in (metadata or {}).items()} or None
    alphas = {k.removeprefix(DENOISER_PREFIX): v for k, v in (alphas or {}).items() if k.startswith(DENOISER_PREFIX)} or None
    if alphas and metadata:  # diffusers' load_lora_adapter refuses the pair too
        raise AdapterError(f"lora {str(path)!r} has both `.alpha` keys and a LoraConfig in its metadata: keep one")
    try:  # the file's metadata builds the config: r=0, an unknown key or a text alpha fail inside peft
        config = _lora_config(state_dict, alphas, metadata, transformer)
    except AdapterError:
        raise
    except Exception as err:
        raise AdapterError(f"lora {str(path)!r}: its LoraConfig (metadata, `.alpha` keys or ranks) is not valid: "
                           f"{type(err).__name__}: {err}") from None  # fmt: skip
    if config.use_dora:
        raise AdapterError(f"lora {str(path)!r} is a DoRA adapter, which adapter slots do not support")
    modules = {}
    for name in sorted({k.split(".lora_")[0] for k in state_dict}):
        modules[name] = _checked_module(name, state_dict, transformer, config, path)
    return LoraWeights(str(path), modules, _digest(modules))


def _state_dict_reader(pipeline_class: str) -> tuple[Callable, str]:
    """How diffusers reads a LoRA file for this family: the pipeline's own `lora_state_dict` (with its
    key conversions), or, for a pipeline diffusers gives no LoRA loader (HunyuanVideo15Pipeline), the
    denoiser's `load_lora_adapter` reading (peft keys under `transformer.`, no conversion)."""
    pipeline = getattr(diffusers, pipeline_class)
    if hasattr(pipeline, "lora_state_dict"):
        return pipeline.lora_state_dict, f"{pipeline_class}.lora_state_dict"
    return _adapter_state_dict, f"{pipeline_class}'s denoiser's load_lora_adapter"


def _adapter_state_dict(path: str, return_lora_metadata: bool = True) -> tuple[dict, dict | None]:
    """(state dict, LoRA metadata) as `PeftAdapterMixin.load_lora_adapter(path, use_safetensors=True)`
    reads a local file (the metadata is read only from a safetensors file, as the pipelines' loaders do)."""
    from diffusers.loaders.lora_base import _fetch_state_dict

    return _fetch_state_dict(path, weight_name=None, use_safetensors=True, local_files_only=True, cache_dir=None,
                             force_download=False, proxies=None, token=None, revision=None, subfolder=None,
                             user_agent={"file_type": "attn_procs_weights", "framework": "pytorch"}, allow_pickle=False)  # fmt: skip


def check_safetensors(path: Path) -> None:
    """Refuse, before anything reads it whole, a path that is not a regular file holding a safetensors
    header: diffusers would fall back to `torch.load` and then read an unknown file as text."""
    shown = str(path) if len(str(path)) <= 300 else f"{str(path)[:300]}... ({len(str(path))} characters)"
    try:
        if not path.is_file():
            raise AdapterError(f"lora path {shown!r} is not a file: pass a local .safetensors file")
        if path.suffix != ".safetensors":
            raise AdapterError(f"lora path {shown!r}: adapters load from .safetensors files only")
        with path.open("rb") as file:  # 8 bytes of header length, then the JSON header
            head = file.read(9)
        size = path.stat().st_size
    except OSError as err:  # a name too long, a permission denied: the path, not a traceback
        raise AdapterError(f"lora path {shown!r} cannot be opened: {err.strerror or type(err).__name__}") from None
    length = int.from_bytes(head[:8], "little") if len(head) == 9 else -1
    if length <= 0 or length > min(size - 8, MAX_SAFETENSORS_HEADER) or head[8:9] != b"{":
        raise AdapterError(f"lora path {shown!r} is not a safetensors file (no valid header)")


def _lora_config(state_dict: dict, alphas: dict | None, metadata: dict | None, transformer: nn.Module):
    """The LoraConfig diffusers builds for this state dict, its network alphas or its metadata when
    it loads it (diffusers/loaders/peft.py)."""
    from diffusers.utils.peft_utils import _create_lora_config

    rank = {f"^{k}": v.shape[1] for k, v in state_dict.items() if "lora_B" in k and v.ndim > 1}
    if not rank:
        raise AdapterError("lora: the file has no lora_B factor of two dimensions (no rank to read)")
    return _create_lora_config(state_dict, alphas, metadata, rank, model_state_dict=transformer.state_dict())


def _scaling(config, name: str, path: Path) -> float:
    """The scaling peft gives module `name` under `config` (LoraModel._create_and_replace, LoraLayer.update_layer),
    refused naming the file unless it is a finite number within float32's range."""
    from peft.utils.other import get_pattern_key

    r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), name), config.r)
    alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), name), config.lora_alpha)
    try:
        scaling = float(alpha / math.sqrt(r) if config.use_rslora else alpha / r)
    except (TypeError, ZeroDivisionError, ValueError) as err:
        raise AdapterError(f"lora {str(path)!r}: module {name}: lora_alpha={alpha!r} and r={r!r} give no scaling "
                           f"({type(err).__name__}: {err}); both must be numbers, r > 0") from None  # fmt: skip
    if not math.isfinite(scaling) or abs(scaling) > FLOAT32_MAX:
        raise AdapterError(f"lora {str(path)!r}: module {name}: scaling lora_alpha / r = {scaling!r} (lora_alpha={alpha!r}, "
                           f"r={r!r}) is not a finite float32")  # fmt: skip
    return scaling


def _checked_module(name: str, state_dict: dict, transformer: nn.Module, config, path: Path) -> LoraModule:
    key_a, key_b = f"{name}.lora_A.weight", f"{name}.lora_B.weight"
    if key_a not in state_dict or key_b not in state_dict:
        raise AdapterError(f"lora key {DENOISER_PREFIX}{name}: needs both {key_a!r} and {key_b!r}")
    try:
        module = transformer.get_submodule(name)
    except AttributeError:
        raise AdapterError(f"lora key {DENOISER_PREFIX}{key_a} names module {name!r}, which this denoiser "
                           f"({type(transformer).__name__}) does not have") from None  # fmt: skip
    if type(module) is not nn.Linear:
        raise AdapterError(f"lora key {DENOISER_PREFIX}{key_a}: module {name!r} is a {type(module).__name__}; "
                           "adapter slots adapt nn.Linear layers only")  # fmt: skip
    down, up = state_dict[key_a], state_dict[key_b]
    out_features, in_features = module.weight.shape
    if down.ndim != 2 or up.ndim != 2 or down.shape[1] != in_features or up.shape[0] != out_features or up.shape[1] != down.shape[0]:
        raise AdapterError(f"lora key {DENOISER_PREFIX}{key_a}: factors {list(down.shape)} and {list(up.shape)} do not "
                           f"fit {name} ({in_features} -> {out_features}): expected [r, {in_features}] and [{out_features}, r]")  # fmt: skip
    bias = state_dict.get(f"{name}.lora_B.bias")
    if bias is not None and list(bias.shape) != [out_features]:
        raise AdapterError(f"lora key {DENOISER_PREFIX}{name}.lora_B.bias has shape {list(bias.shape)}, expected [{out_features}]")
    if down.shape[0] == 0:
        raise AdapterError(f"lora key {DENOISER_PREFIX}{key_a} has rank 0 (factors {list(down.shape)}): nothing to adapt")
    for key, t in ((key_a, down), (key_b, up), (f"{name}.lora_B.bias", bias)):
        if t is not None and not torch.isfinite(t).all():
            raise AdapterError(f"lora key {DENOISER_PREFIX}{key} holds NaN or Inf values")
    scaling = _scaling(config, name, path)
    bound = abs(scaling) * float(up.abs().max()) * float(down.abs().max()) * down.shape[0]
    if bias is not None:
        bound = max(bound, abs(scaling) * float(bias.abs().max()))
    if bound > FLOAT32_MAX:
        raise AdapterError(f"lora key {DENOISER_PREFIX}{name}: scaling x factors reach {bound:.3g}, past float32's range "
                           f"({FLOAT32_MAX:.3g}): the adapter would add Inf")  # fmt: skip
    return LoraModule(down.detach().float(), up.detach().float(), None if bias is None else bias.detach().float(), scaling)


def _digest(modules: dict[str, LoraModule]) -> str:
    h = hashlib.sha256()
    for name, m in modules.items():
        h.update(f"{name}:{m.scaling!r}".encode())
        for t in (m.down, m.up, m.up_bias):
            if t is not None:
                h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
