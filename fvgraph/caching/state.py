"""One request's step caching between its steps: the typed `caching` field of a loop state.

A method's state holds its settings, its decision's accumulators (`memo`), what the last full step
kept, and the counts reported in `Result.cache`. The loop asks it, before each denoise launch, which
step kind runs and with which extra inputs (`plan`), and hands it the launch's outputs afterwards
(`advance`); the method decides, the loop only carries the state. The decision object (`policy`) is
transient: rebuilt from the settings after a resume (`bind`).

A state saves as plain values (`saved`) and is read back by `fvgraph.caching.methods.load_state`,
which checks every field before it builds one; `check` is the resume-time check of what the values
mean (tensor counts, dims, finiteness).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn

import torch

from fvgraph.caching.settings import CacheSettings, PolicyContext
from fvgraph.contract.plan import StepResult

Fail = Callable[[str, str], NoReturn]  # (field, rule): raises, naming the request


@dataclass(frozen=True)
class TensorLayouts:
    """What the request's tensors look like on this engine, for the resume-time check of what is kept."""

    tokens: tuple[int, ...]  # [1, S, D]: the sections' stream for the request's latents (a kept residual)
    token_dtype: torch.dtype
    latents: tuple[int, ...]  # [1, C, F, h, w]
    blocks: tuple[int, ...]  # [1, S', D]: the blocks' whole state (FLUX's text stream too)


def zero_counts() -> dict[str, int]:
    """Denoiser calls computed and reused (one per CFG branch and step); FLOPs run and uncached."""
    return {"computed": 0, "reused": 0, "flops": 0, "flops_uncached": 0}


@dataclass
class StepCachingState(abc.ABC):
    settings: CacheSettings
    memo: dict[str, Any] = field(default_factory=dict)  # the policy's accumulators after the last step
    kept: list[torch.Tensor] = field(default_factory=list)  # what the last full step kept, per CFG branch
    counts: dict[str, int] = field(default_factory=zero_counts)
    policy: Any = field(default=None, metadata={"transient": True})  # built from `settings` by bind()
    # The planned launch's FLOPs and the uncached step's (counted by the loop; fvgraph/loops/step_flops.py).
    flops: tuple[int, int] | None = field(default=None, metadata={"transient": True})

    tensor_lists: ClassVar[tuple[str, ...]] = ("kept",)  # fields that hold tensors (moved by `to`)

    def bind(self, context: PolicyContext) -> Any:
        """The request's decision object, built once per engine from the settings and the request."""
        if self.policy is None:
            self.policy = self.settings.policy(int(context.timesteps.shape[0]), context)
        return self.policy

    @abc.abstractmethod
    def plan(self, cfg: bool, step_index: int, inputs: dict[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]]:
        """The kind of the request's next denoise launch and its inputs (the plain step's `inputs`
        with what the method adds). Pure: advance() repeats the decision to move the state on."""

    @abc.abstractmethod
    def advance(self, cfg: bool, step_index: int, result: StepResult) -> bool:
        """Fold one launch's outputs into the state; False while the step has a launch still to run."""

    def counted(self, computed: int, reused: int) -> None:
        self.counts["computed"] = self.counts.get("computed", 0) + computed
        self.counts["reused"] = self.counts.get("reused", 0) + reused

    def end(self) -> None:
        """After the last step: what was kept is dead weight."""
        for name in self.tensor_lists:
            setattr(self, name, [])

    def to(self, device: torch.device) -> StepCachingState:
        for name in self.tensor_lists:
            setattr(self, name, [t.to(device) for t in getattr(self, name)])
        self.policy = None  # built on the other engine's device: rebuilt here on demand
        return self

    def report(self) -> dict:
        """What Result.cache says: the method and the counts."""
        return {"method": self.settings.method, **self.counts}

    def saved(self) -> dict[str, Any]:
        """The state as plain values (methods.load_state reads it back)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("transient")}
        return {**fields, "settings": self.settings.model_dump(mode="json")}

    def check(self, fail: Fail, cfg: bool, phase: str, layouts: TensorLayouts) -> None:
        """Resume-time check of the values; `fail(field, rule)` raises naming the request."""
        expected = set(self.settings.memo_keys)
        if not isinstance(self.memo, dict) or set(self.memo) != expected:
            fail("caching.memo", f"must hold exactly {sorted(expected)} for method {self.settings.method!r}, got {sorted(self.memo)}")
        for key, value in self.memo.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value != value or abs(value) == float("inf"):
                fail("caching.memo", f"{key}={value!r} must be a finite number")
        if set(self.counts) != set(zero_counts()) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0
                                                         for v in self.counts.values()):  # fmt: skip
            fail("caching.counts", f"must hold the ints >= 0 {sorted(zero_counts())}, got {self.counts!r}")
        branches = 2 if cfg else 1
        per_branch, shape, dtype = self.kept_layout(fail, layouts)
        if len(self.kept) not in (0, branches * per_branch):
            fail("caching.kept", f"must hold 0 or {branches * per_branch} tensors ({per_branch} per CFG branch), got {len(self.kept)}")
        for i, kept in enumerate(self.kept):
            check_tensor(fail, f"caching.kept[{i}]", kept, shape, dtype)

    def kept_layout(self, fail: Fail, layouts: TensorLayouts) -> tuple[int, tuple[int, ...], torch.dtype]:
        """(tensors per CFG branch, shape and dtype of each) that `kept` holds once a step computed:
        one residual of the blocks' tokens per branch unless the method keeps something else."""
        return 1, layouts.tokens, layouts.token_dtype


def check_tensor(fail: Fail, name: str, t: Any, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Exactly the shape and dtype the step produces: a tensor cut to a broadcastable shape would run
    and give wrong latents, a wider dtype would fail inside the step."""
    if not isinstance(t, torch.Tensor):
        fail(name, f"must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        fail(name, f"must be {dtype} of shape {list(shape)}, got {t.dtype} of shape {list(t.shape)}")
    if not torch.isfinite(t).all():
        fail(name, "holds NaN or Inf values")
