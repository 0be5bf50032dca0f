"""Bucket lists: the batch sizes and latent shapes graphs are prepared for.

A group of compatible steps runs as one graph padded up to the smallest batch bucket that holds it;
a larger group is split into max-bucket chunks. Latent shapes cannot be padded (a DiT attends over
every token), so shape buckets are exact: with `shapes` set, only those (frames, height, width)
pixel shapes get compiled graphs, and any other shape runs through the eager fallback; without it,
the first `max_shapes` distinct shapes get graphs, on demand, and later ones run eagerly.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class BucketSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_sizes: tuple[int, ...] = Field(default=(1, 2, 4, 8), description="Batch buckets, ascending.")
    shapes: tuple[tuple[int, int, int], ...] | None = Field(
        default=None, description="(num_frames, height, width) with graphs; None: up to max_shapes, on demand."
    )
    max_shapes: int = Field(
        default=16, ge=1,
        description="With shapes None: at most this many distinct shapes get compiled graphs, in order of first "
        "use; later shapes run eagerly. A compiled shape holds its graphs and static buffers for the engine's "
        "life (25-50 MB per shape for tiny-wan at -O1), so the bound is the memory bound.",
    )  # fmt: skip

    @field_validator("batch_sizes")
    @classmethod
    def _ascending_positive(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value or any(b < 1 for b in value) or list(value) != sorted(set(value)):
            raise ValueError(f"batch_sizes={value} must be distinct positive sizes in ascending order")
        return value

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    def batch_for(self, n: int) -> int:
        """The smallest bucket holding `n` rows (n <= max_batch)."""
        return next(b for b in self.batch_sizes if b >= n)

    def chunks(self, n: int) -> list[int]:
        """Sizes of the groups `n` compatible rows are split into, max-bucket first."""
        full, rest = divmod(n, self.max_batch)
        return [self.max_batch] * full + ([rest] if rest else [])

    def covers(self, frames: int, height: int, width: int) -> bool:
        return self.shapes is None or (frames, height, width) in self.shapes
