"""Where a checkpoint's files are: a local diffusers folder as given, or a Hub repo id resolved through
huggingface_hub's own cache, as `DiffusionPipeline.from_pretrained(id)` resolves it.

    local_checkpoint("/models/Wan2.1-T2V-1.3B-Diffusers")  -> that folder
    local_checkpoint("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")   -> $HF_HUB_CACHE/models--Wan-AI--.../snapshots/<commit>

A repo id is looked up in the cache first (no network call when it is there); only when it is missing,
and `HF_HUB_OFFLINE` is not set, is it downloaded (`snapshot_download`, which also honours `HF_TOKEN`).
Offline and missing is one line naming the id, the cache and `HF_HUB_OFFLINE`. The environment is read
at each call, not at import, so a process (or a test) that sets `HF_HUB_CACHE` / `HF_HUB_OFFLINE`
after importing fvgraph is obeyed.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CheckpointNotFound", "hub_cache_dir", "hub_offline", "hub_repo_id_of", "local_checkpoint", "looks_like_repo_id"]


class CheckpointNotFound(ValueError):
    """A checkpoint that is neither a local folder nor a Hub repo id this process can reach."""


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it, read now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_cache_dir() -> Path:
    """The Hub cache huggingface_hub uses (HF_HUB_CACHE, else HF_HOME/hub), read now."""
    from huggingface_hub import constants

    configured = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if configured is None and os.environ.get("HF_HOME"):
        configured = os.path.join(os.environ["HF_HOME"], "hub")
    return Path(os.path.expanduser(os.path.expandvars(configured))) if configured else Path(constants.HF_HUB_CACHE)


def looks_like_repo_id(text: str) -> bool:
    """True for ORG/NAME (or NAME) as the Hub spells repo ids; a path that exists is never one."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if text.startswith((".", "/", "~")) or text.count("/") > 1 or Path(text).exists():
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def local_checkpoint(checkpoint: str | Path) -> Path:
    """The local folder holding `checkpoint`'s files: the folder itself, or a repo id's snapshot in the
    Hub cache (downloaded first where the network and HF_HUB_OFFLINE allow). CheckpointNotFound otherwise."""
    text = str(checkpoint)
    if not looks_like_repo_id(text):
        return Path(checkpoint)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(text, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if hub_offline():
        raise CheckpointNotFound(f"checkpoint {text!r} is not a local folder and not in the Hub cache {cache}, and "
                                 f"HF_HUB_OFFLINE=1 forbids a download: fetch it where the network is allowed "
                                 f"(`hf download {text}`) or give a local diffusers folder")  # fmt: skip
    try:
        return Path(snapshot_download(text, cache_dir=cache))
    except Exception as err:  # no network, no such repo, a gated repo without a token: one line, naming the id
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointNotFound(f"checkpoint {text!r} is not a local folder, not in the Hub cache {cache}, and "
                                 f"downloading it failed: {reason} (HF_HUB_OFFLINE=1 keeps to the cache)") from None


def hub_repo_id_of(folder: str | Path) -> str | None:
    """The repo id whose snapshot `folder` is (a folder under a Hub cache's models--ORG--NAME/snapshots/),
    as huggingface_hub's cache scan names it; None for any other folder."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound, CorruptedCacheException

    path = Path(folder).resolve()
    for snapshots in path.parents:
        if snapshots.name == "snapshots":
            repo_folder = snapshots.parent
            try:
                cache = scan_cache_dir(repo_folder.parent)
            except (CacheNotFound, CorruptedCacheException, OSError):
                return None
            return next((repo.repo_id for repo in cache.repos if repo.repo_path.resolve() == repo_folder), None)
    return None
