"""Component instances for a card: built from seeded weights or loaded from a diffusers folder.

A checkpoint is a diffusers folder on local disk (model_index.json, one subfolder per component,
safetensors shards with their index). Nothing here downloads: a missing folder or file is an error
that names the path.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from torch import nn

from fvgraph.models.byte_tokenizer import build_byte_tokenizer
from fvgraph.card import ComponentSpec, ModelCard, SamplerSpec
from fvgraph.contract.model_facts import ModelFacts

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


class CheckpointError(ValueError):
    """A checkpoint folder is missing, incomplete or does not match the card."""


@dataclass
class Components:
    """The loaded model: eval-mode modules on one device, plus the tokenizer. The text encoder and
    tokenizer are None when the engine was built without them (prompts then come as embeddings)."""

    transformer: nn.Module
    vae: nn.Module
    text_encoder: nn.Module | None
    tokenizer: object | None
    device: torch.device
    weights_version: str = ""
    transformer_2: nn.Module | None = None  # the low-noise expert of two-expert models
    image_encoder: nn.Module | None = None  # CLIP vision tower of image-conditioned models
    image_processor: object | None = None

    @property
    def facts(self) -> ModelFacts:
        """What the loaded weights' configs say (widths, channels, patch, VAE scales, experts)."""
        return ModelFacts.of(self.transformer, self.vae, self.transformer_2)

    def modules(self) -> dict[str, object]:
        """Every loaded component by card name (those not loaded left out)."""
        names = ("transformer", "transformer_2", "vae", "text_encoder", "tokenizer", "image_encoder", "image_processor")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def save_pretrained(self, folder: str | Path, card: ModelCard, max_shard_size: str | None = None) -> Path:
        """Write a diffusers-layout checkpoint (what users' folders look like) for this model."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        shard = {"max_shard_size": max_shard_size} if max_shard_size else {}
        index = {"_class_name": card.pipeline_class}
        for name, module in self.modules().items():
            library = "diffusers" if type(module).__module__.startswith("diffusers") else "transformers"
            if isinstance(module, nn.Module):
                module.save_pretrained(folder / card.components[name].subfolder, **shard)
            else:  # tokenizer, image processor
                module.save_pretrained(folder / card.components[name].subfolder)
            index[name] = [library, "AutoTokenizer" if name == "tokenizer" else type(module).__name__]
        scheduler = diffusers_scheduler(card.recipe.sampler)
        scheduler.save_pretrained(folder / "scheduler")
        index["scheduler"] = ["diffusers", type(scheduler).__name__]
        (folder / "model_index.json").write_text(json.dumps(index, indent=2))
        return folder


def _build_seeded(name: str, spec: ComponentSpec, seed: int, card: ModelCard):
    """Deterministic weights: each component draws from its own generator state seeded by card seed + name."""
    if spec.kind == "tokenizer":
        return build_byte_tokenizer(model_max_length=card.shapes.text_len)
    cls = spec.resolve_class()
    if spec.kind == "image_processor":  # no weights: its config is all of it
        return cls(**spec.config)
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream untouched
        torch.manual_seed(seed + sum(name.encode()))
        if cls.__module__.startswith("transformers"):
            module = cls(cls.config_class(**spec.config))
        else:
            module = cls(**spec.config)
    return _cast(module, DTYPES[spec.dtype])


def _cast(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast like from_pretrained(torch_dtype=...): submodules a model keeps in fp32 stay fp32."""
    if dtype == torch.float32:  # constructors already build fp32 weights
        return module
    nn.Module.to(module, dtype)  # plain cast; the fp32 exceptions are restored just below
    keep = getattr(module, "_keep_in_fp32_modules", None) or []
    if dtype != torch.float32 and keep:
        for name, sub in module.named_modules():
            if any(part in keep for part in name.split(".")):
                sub.to(torch.float32)
    return module


def _load_from_folder(name: str, spec: ComponentSpec, folder: Path, dtype: torch.dtype):
    path = folder / spec.subfolder
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {folder}: component {name!r} expects folder {path}, which does not exist")
    if spec.kind == "tokenizer":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    cls = spec.resolve_class()
    if spec.kind == "image_processor":
        return cls.from_pretrained(path)
    if cls.__module__.startswith("transformers"):
        return cls.from_pretrained(path, dtype=dtype)
    return cls.from_pretrained(path, torch_dtype=dtype)


def _own_storage(module: nn.Module) -> None:
    """Copy tensors out of the memory-mapped safetensors file into fresh, aligned allocations.

    Mapped tensors sit at arbitrary byte offsets, and CPU BLAS picks other code paths for unaligned
    operands: results then differ in the last bit from the same weights held in ordinary memory.
    """
    for tensor in (*module.parameters(), *module.buffers()):
        tensor.data = tensor.data.clone()


def load_components(card: ModelCard, checkpoint: str | Path | None, device: torch.device,
                    skip: frozenset[str] = frozenset()) -> Components:  # fmt: skip
    """Build (card seed) or load (checkpoint folder) every component but those in `skip`, cast and
    placed on `device`. An optional component (a second expert) absent from the folder is None."""
    folder = None
    if checkpoint is not None:
        folder = Path(checkpoint)
        if not (folder / "model_index.json").is_file():
            raise CheckpointError(f"checkpoint={str(folder)!r} is not a diffusers folder: model_index.json not found")
    elif not card.embeds_weights:
        raise CheckpointError(
            f"card {card.card_id!r} has no embedded weights: pass checkpoint=<local diffusers folder>"
        )
    built = {}
    with torch.device("cpu"):
        for name, spec in card.components.items():
            if name in skip or (folder is not None and spec.optional and not (folder / spec.subfolder).is_dir()):
                continue
            if folder is None:
                module = _build_seeded(name, spec, card.seed or 0, card)
            else:
                module = _load_from_folder(name, spec, folder, DTYPES[spec.dtype])
            if isinstance(module, nn.Module):
                module = module.to(device).eval().requires_grad_(False)
                if folder is not None and device.type == "cpu":
                    _own_storage(module)
            built[name] = module
    version = _checkpoint_fingerprint(folder) if folder is not None else _content_hash(card, built)
    return Components(device=device, weights_version=version, **{"text_encoder": None, "tokenizer": None, **built})


def _content_hash(card: ModelCard, built: dict) -> str:
    """Seeded weights: hash their bytes (they are small, and the init code may change across releases)."""
    digest = hashlib.blake2b(card.card_id.encode(), digest_size=12)
    for name in sorted(built):
        module = built[name]
        if isinstance(module, nn.Module):
            for key, tensor in module.state_dict().items():
                digest.update(f"{name}.{key}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
                digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _checkpoint_fingerprint(folder: Path) -> str:
    """A checkpoint: relative path, size, mtime and safetensors header of every file (not the bytes: 28 GB)."""
    digest = hashlib.blake2b(digest_size=12)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.relative_to(folder)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        if path.suffix == ".safetensors":
            with path.open("rb") as handle:
                header_len = int.from_bytes(handle.read(8), "little")
                digest.update(handle.read(min(header_len, 1 << 24)))
    return digest.hexdigest()


def diffusers_scheduler(spec: SamplerSpec) -> FlowMatchEulerDiscreteScheduler | UniPCMultistepScheduler:
    """The diffusers scheduler this sampler mirrors (the reference, and what checkpoints store)."""
    cls = FlowMatchEulerDiscreteScheduler if spec.name == "flow_euler" else UniPCMultistepScheduler
    return cls(**spec.config)
