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
from fvgraph.models.placement import HostParts, place_on_device

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
    text_encoder_2: nn.Module | None = None  # a second text encoder (FLUX: T5 beside CLIP)
    tokenizer_2: object | None = None
    checkpoint: Path | None = None  # the folder the weights were loaded from (None: the card's seeded weights)
    on_host: tuple[nn.Module, ...] = ()  # parts offload holds in host memory: never placed on `device` whole

    def place(self, module: nn.Module) -> nn.Module:
        """`module` (a step holding components) on the device, but for the parts offload holds in host memory."""
        return place_on_device(module, self.device, self.on_host)

    @property
    def facts(self) -> ModelFacts:
        """What the loaded weights' configs say (widths, channels, patch, VAE scales, experts)."""
        return ModelFacts.of(self.transformer, self.vae, self.transformer_2)

    def modules(self) -> dict[str, object]:
        """Every loaded component by card name (those not loaded left out)."""
        names = ("transformer", "transformer_2", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                 "image_encoder", "image_processor")
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
            index[name] = [library, "AutoTokenizer" if name.startswith("tokenizer") else type(module).__name__]
        scheduler = diffusers_scheduler(card.recipe.sampler)
        scheduler.save_pretrained(folder / "scheduler")
        index["scheduler"] = ["diffusers", type(scheduler).__name__]
        (folder / "model_index.json").write_text(json.dumps(index, indent=2))
        return folder


def _build_seeded(name: str, spec: ComponentSpec, seed: int, card: ModelCard):
    """Deterministic weights: each component draws from its own generator state seeded by card seed + name."""
    if spec.kind == "tokenizer":
        config = spec.config or {}
        tokenizer = build_byte_tokenizer(config.get("model_max_length", card.shapes.text_len), tuple(config.get("special_tokens", ())))
        tokenizer.chat_template = config.get("chat_template")  # a pipeline that wraps texts in a chat (HunyuanVideo-1.5's)
        return tokenizer
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
    cls = spec.resolve_class()
    try:
        if spec.kind == "tokenizer":
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path)
        if spec.kind == "image_processor":
            return cls.from_pretrained(path)
        dtype_arg = {"dtype": dtype} if cls.__module__.startswith("transformers") else {"torch_dtype": dtype}
        module, info = cls.from_pretrained(path, output_loading_info=True, **dtype_arg)
    except Exception as err:  # a config or weights file the class cannot take: name the component
        raise CheckpointError(
            f"checkpoint {folder}: component {name!r} ({path}) does not load into {cls.__name__}: "
            f"{type(err).__name__}: {str(err)[:500]}"
        ) from err
    _check_loading_info(name, path, info)
    return module


def _check_loading_info(name: str, path: Path, info: dict) -> None:
    """from_pretrained fills in weights its config has but the files lack (random or meta tensors) and
    drops stored weights its config has no place for: either means config.json and weights disagree."""
    problems = []
    for key, what in (("missing_keys", "weights config.json declares but the files lack"),
                      ("unexpected_keys", "stored weights config.json has no place for"),
                      ("mismatched_keys", "weights whose stored shape differs from config.json's"),
                      ("error_msgs", "load errors")):  # fmt: skip
        found = sorted(map(str, info.get(key) or ()))
        if found:
            problems.append(f"{len(found)} {what} (e.g. {', '.join(found[:3])})")
    if problems:
        raise CheckpointError(
            f"checkpoint component {name!r} ({path}): its config.json and its weights disagree: "
            f"{'; '.join(problems)}; restore the config.json the weights were saved with"
        )


def read_model_index(folder: Path, card: ModelCard, skip: frozenset[str]) -> set[str]:
    """Check model_index.json against the card; returns the names of the card's components it lists.

    Every component the folder lists must be one the card loads (else it would be silently dropped:
    a second expert on a one-expert card), and every component the card needs must be listed with
    the card's class (diffusers itself loads only what the index lists)."""
    index_path = folder / "model_index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(
            f"{index_path} is not readable JSON ({type(err).__name__}: {err}): "
            "a diffusers folder's model_index.json maps component names to [library, class]"
        ) from err
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise CheckpointError(f"{index_path} must be a JSON object with a string '_class_name' (the pipeline class), "
                              f"got {str(index)[:120]!r}")  # fmt: skip
    listed = set()
    for key, value in index.items():
        is_entry = isinstance(value, list) and len(value) == 2 and all(p is None or isinstance(p, str) for p in value)
        names = _components_listed_as(card, key)
        if names or key == "scheduler":
            if not is_entry:
                raise CheckpointError(f"{index_path}: component {key!r} must be [library, class] (or [null, null] "
                                      f"when absent), got {str(value)[:120]!r}")  # fmt: skip
        if not is_entry or value == [None, None] or key.startswith("_"):
            continue  # a pipeline setting (boundary_ratio, expand_timesteps) or an absent component
        if key in ("scheduler", "guider"):
            continue  # the card's recipe sets the sampler (and the guidance, a guider folder's: the family's loop reads it)
        if not names:
            raise CheckpointError(
                f"{index_path} lists component {key!r} ({value[0]}.{value[1]}), which card {card.card_id!r} does not "
                f"load (it loads {', '.join(card.components)}): use a card made for this folder"
            )
        for name in names:
            spec = card.components[name]
            expected = spec.cls.rpartition(".")[2]
            if spec.kind not in ("tokenizer", "image_processor") and value[1] != expected:
                raise CheckpointError(f"{index_path}: component {key!r} is {value[1]!r}, card {card.card_id!r} loads "
                                      f"{expected!r}: use a card made for this folder")  # fmt: skip
        listed.update(names)
    for name, spec in card.components.items():
        if name not in listed and name not in skip and not spec.optional:
            raise CheckpointError(f"{index_path} does not list component {name!r} (or lists it as [null, null]), "
                                  f"which card {card.card_id!r} needs")  # fmt: skip
    return listed


def _components_listed_as(card: ModelCard, key: str) -> list[str]:
    """The card's components a model_index.json key stands for: the one of that name, else those kept in
    the folder of that name (Qwen-Image-Edit's `processor`: the image processor and the tokenizer its
    pipeline prompts with)."""
    if key in card.components:
        return [key]
    return [name for name, spec in card.components.items() if spec.subfolder == key]


def _own_storage(module: nn.Module) -> None:
    """Copy tensors out of the memory-mapped safetensors file into fresh, aligned allocations.

    Mapped tensors sit at arbitrary byte offsets, and CPU BLAS picks other code paths for unaligned
    operands: results then differ in the last bit from the same weights held in ordinary memory.
    """
    for tensor in (*module.parameters(), *module.buffers()):
        tensor.data = tensor.data.clone()


def load_components(card: ModelCard, checkpoint: str | Path | None, device: torch.device,
                    skip: frozenset[str] = frozenset(), host_parts: HostParts | None = None) -> Components:  # fmt: skip
    """Build (card seed) or load (checkpoint folder) every component but those in `skip`, cast and
    placed on `device`, but for the parts `host_parts` names (offload's: they stay in host memory, each
    component built on the CPU first). An optional component absent from the folder's model_index.json is None."""
    folder = None
    if checkpoint is not None:
        folder = Path(checkpoint)
        if not (folder / "model_index.json").is_file():
            raise CheckpointError(f"checkpoint={str(folder)!r} is not a diffusers folder: model_index.json not found")
    elif not card.embeds_weights:
        published = f" such as {card.hub_repos[0]}" if card.hub_repos else ""
        raise CheckpointError(f"card {card.card_id!r} has no embedded weights: give its checkpoint (--checkpoint, "
                              f"checkpoint=), a local diffusers folder or a Hub repo id{published}")  # fmt: skip
    listed = read_model_index(folder, card, skip) if folder is not None else set(card.components)
    seeded = hashlib.blake2b(card.card_id.encode(), digest_size=12) if folder is None else None
    built, on_host = {}, []
    # Seeded weights are hashed as each is built, on the CPU, before it is placed: in name order, the
    # digest's. A folder's load goes in the card's order (its errors name the first missing component).
    for name in sorted(card.components) if folder is None else card.components:
        if name in skip or name not in listed:  # not listed: an optional component the folder lacks
            continue
        module = load_component(card, name, folder)
        if isinstance(module, nn.Module):
            if seeded is not None:
                _hash_weights(seeded, name, module)
            held = host_parts(name, module) if host_parts is not None else ()
            module = place_on_device(module.eval().requires_grad_(False), device, held)
            if folder is not None and device.type == "cpu":
                _own_storage(module)
            on_host += held
        built[name] = module
    version = _checkpoint_fingerprint(folder) if folder is not None else seeded.hexdigest()
    return Components(device=device, weights_version=version, checkpoint=folder, on_host=tuple(on_host),
                      **{"text_encoder": None, "tokenizer": None, "text_encoder_2": None, "tokenizer_2": None, **built})


def load_component(card: ModelCard, name: str, checkpoint: Path | None) -> nn.Module:
    """One component as `load_components` builds it, on the CPU and before it is placed: from the card's
    seed (`checkpoint` None) or from the folder, in the card's dtype (an engine's wake reloads its denoiser so)."""
    spec = card.components[name]
    with torch.device("cpu"):
        if checkpoint is None:
            return _build_seeded(name, spec, card.seed or 0, card)
        return _load_from_folder(name, spec, Path(checkpoint), DTYPES[spec.dtype])


def _hash_weights(digest: hashlib.blake2b, name: str, module: nn.Module) -> None:
    """Seeded weights: hash their bytes (they are small, and the init code may change across releases)."""
    for key, tensor in module.state_dict().items():
        digest.update(f"{name}.{key}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


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
    if spec.timestep_list is not None:  # a distilled recipe's list: the flow-matching scheduler at its shift
        return FlowMatchEulerDiscreteScheduler(shift=float(spec.config["flow_shift"]))
    cls = FlowMatchEulerDiscreteScheduler if spec.name in ("flow_euler", "flow_euler_image") else UniPCMultistepScheduler
    return cls(**spec.config)
