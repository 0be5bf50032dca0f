"""The VAE's decode (and encode) as one step per tile, so a large decode is many short steps.

With `vae_tiling` on, a request whose latents are larger than one tile decodes through the
`vae_decode_tile` kind: each step decodes one tile (fvgraph/models/vae_tiles.py runs it as
diffusers' tiled decode does), and the loop blends it into the request's `TileAssembly` as it comes
back. Between two tiles the scheduler runs other requests' steps, and a cancel lands, as between
any two steps. Only one row of blended tiles and the kept parts of the finished rows are held:
never an untiled pass beside the tiles. Latents no larger than one tile decode whole, as diffusers
decodes them then.

Each tile runs alone (batch 1): a tile's convolutions are already large (a 256 x 256 Wan tile at 81
frames is about 5.3 M output pixels per conv), so batching tiles of several requests would buy
little and make a request's pixels depend on its neighbours' tile shapes.
"""

from __future__ import annotations

import torch
from torch import nn

from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.contract.step_kind import Role, StepKind
from fvgraph.loops.causal_decode import VAE_DECODE_CHUNK, ChunkDecodeStep, ChunkedDecode, chunk_kind, is_causal_video_vae
from fvgraph.loops.loop_parts import Decoder
from fvgraph.models.vae_tiles import TileGrid, VaeTiling

from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

VAE_DECODE, VAE_DECODE_TILE = "vae_decode", "vae_decode_tile"
VAE_ENCODE, VAE_ENCODE_TILE, VAE_ENCODE_END = "vae_encode", "vae_encode_tile", "vae_encode_end"
VAE_DECODE_TILE_KIND = StepKind(VAE_DECODE_TILE, component="vae", phase="vae_decode", inputs={"latents": Role.STEP},
                                outputs={"tile": Role.RESULT})  # fmt: skip
# A media conditioning's whole encode (Wan I2V's first frame, TI2V's, a video-to-video request's video):
# `image` is the pixels to encode, `latents` the shape witness, `condition` what the conditioning takes.
VAE_ENCODE_KIND = StepKind(VAE_ENCODE, component="vae", phase="vae_encode", inputs={"image": Role.STEP, "latents": Role.STEP},
                           outputs={"condition": Role.RESULT})  # fmt: skip
# Its tiles, then the step that turns the stitched moments into what the whole encode returns.
VAE_ENCODE_TILE_KIND = StepKind(VAE_ENCODE_TILE, component="vae", phase="vae_encode",
                                inputs={"image": Role.STEP, "latents": Role.STEP}, outputs={"moments": Role.RESULT})  # fmt: skip
VAE_ENCODE_END_KIND = StepKind(VAE_ENCODE_END, component="vae", phase="vae_encode",
                               inputs={"moments": Role.STEP, "latents": Role.STEP}, outputs={"condition": Role.RESULT})  # fmt: skip


class TileDecodeStep(nn.Module):
    """One tile of latents -> its decoded tile, before blending (the VAE's own output range)."""

    def __init__(self, decode_step: nn.Module, tiling: VaeTiling):
        super().__init__()
        self.decode_step = decode_step  # the family's whole-decode step: what it feeds the VAE
        self.tiling = tiling

    def forward(self, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"tile": self.tiling.decode_tile(self.decode_step.vae_latents(latents))}


class TileEncodeStep(nn.Module):
    """One tile of a media encode's image -> the VAE's moments for it, before blending."""

    def __init__(self, encode_step: nn.Module, tiling: VaeTiling):
        super().__init__()
        self.encode_step = encode_step  # the conditioning's whole-encode step: what it feeds the VAE
        self.tiling = tiling

    def forward(self, image: torch.Tensor, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"moments": self.tiling.encode_tile(self.encode_step.video(image, latents))}


class EncodeEndStep(nn.Module):
    """The stitched moments -> what the whole encode step returns: the posterior's mode (diffusers'
    DiagonalGaussianDistribution, as `vae.encode(...).latent_dist.mode()`), then the step's own mapping."""

    def __init__(self, encode_step: nn.Module):
        super().__init__()
        self.encode_step = encode_step

    def forward(self, moments: torch.Tensor, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.encode_step.condition(DiagonalGaussianDistribution(moments).mode(), latents)


class TileAssembly:
    """One request's tiles so far, blended as they arrive (row-major, as diffusers blends them): the
    previous row's blended tiles (the next row blends into them), the current row, the kept parts of
    the finished rows."""

    def __init__(self, grid: TileGrid):
        self.grid = grid
        self.count = 0  # tiles added
        self._above: list[torch.Tensor] = []
        self._row: list[torch.Tensor] = []
        self._kept_rows: list[torch.Tensor] = []

    @property
    def done(self) -> bool:
        return self.count == len(self.grid)

    def window(self) -> tuple[slice, slice]:
        """The input window of the next tile."""
        return self.grid.window(self.count)

    def add(self, tile: torch.Tensor, tiling: VaeTiling) -> None:
        j = len(self._row)
        above = self._above[j] if self._above else None
        left = self._row[-1] if self._row else None
        self._row.append(tiling.blend(above, left, tile, self.grid))
        self.count += 1
        if len(self._row) == len(self.grid.cols):
            keep_h, keep_w = self.grid.keep
            self._kept_rows.append(torch.cat([t[..., :keep_h, :keep_w] for t in self._row], dim=-1))
            self._above, self._row = self._row, []
        if self.done:
            self._above = []

    def stitched(self) -> torch.Tensor:
        out = torch.cat(self._kept_rows, dim=-2)
        if self.grid.size is not None:
            out = out[..., : self.grid.size[0], : self.grid.size[1]]
        return out


class Decoding:
    """How a loop decodes its latents: the family's `decoder` whole, one tile per step, or (a causal
    video VAE, untiled) one latent frame per step (fvgraph/loops/causal_decode.py). Each decode step
    that makes frames final leaves them in `state.new_frames` (start frame, pixels) for the engine."""

    def __init__(self, decoder: Decoder, tiling: VaeTiling | None, vae: nn.Module | None = None):
        self.decoder, self.tiling = decoder, tiling
        self.step_kinds = {VAE_DECODE: decoder.kind}
        if tiling is not None:
            self.step_kinds[VAE_DECODE_TILE] = VAE_DECODE_TILE_KIND
        self.chunked = tiling is None and is_causal_video_vae(vae)
        if self.chunked:
            self.step_kinds[VAE_DECODE_CHUNK] = chunk_kind(vae)

    def build(self, components) -> dict[str, nn.Module]:
        whole = self.decoder.build(components)
        steps = {VAE_DECODE: whole}
        if self.tiling is not None:
            steps[VAE_DECODE_TILE] = TileDecodeStep(whole, self.tiling)
        if self.chunked:
            steps[VAE_DECODE_CHUNK] = ChunkDecodeStep(whole)
        return steps

    def plan(self, state) -> WorkPlan:
        if self.chunked:
            if state.chunks is None:  # the first chunk (also after a resume: a saved state keeps no chunks)
                state.chunks = ChunkedDecode()
            return WorkPlan(state.request_id, VAE_DECODE_CHUNK, state.chunks.inputs(state.latents), state.chunks.index)
        tiles = self._tiles(state)
        if tiles is None:
            return WorkPlan(state.request_id, VAE_DECODE, {"latents": state.latents})
        rows, cols = tiles.window()
        return WorkPlan(state.request_id, VAE_DECODE_TILE, {"latents": state.latents[..., rows, cols]}, tiles.count)

    def take(self, state, result: StepResult) -> None:
        """Fold a decode step's result in; `state.decoded` is set once the whole decode is there."""
        if self.chunked:
            start = state.chunks.frames_done
            state.new_frames = (start, state.chunks.take(result))
            if state.chunks.finished(state.latents):
                state.decoded, state.chunks = state.chunks.whole(), None
            return
        if state.tiles is None:
            state.decoded = result["video"]
        else:
            state.tiles.add(result["tile"], self.tiling)
            if not state.tiles.done:
                return
            state.decoded = self.decoder.postprocess(self.tiling.decoded(state.tiles.stitched()))
            state.tiles = None
        state.new_frames = (0, state.decoded)

    def _tiles(self, state) -> TileAssembly | None:
        """The request's tiles so far, started at its first decode step (also after a resume: a saved
        state keeps no tiles, so its decode starts over)."""
        if self.tiling is not None and state.tiles is None:
            grid = self.tiling.decode_grid(*state.latents.shape[-2:])
            state.tiles = None if grid is None else TileAssembly(grid)
        return state.tiles


class TiledEncoding:
    """A media conditioning's `vae_encode` step run in tiles where its image is larger than one tile:
    the tiles, then `vae_encode_end`, whose result the conditioning takes as the whole encode's."""

    step_kinds = {VAE_ENCODE_TILE: VAE_ENCODE_TILE_KIND, VAE_ENCODE_END: VAE_ENCODE_END_KIND}

    def __init__(self, tiling: VaeTiling):
        self.tiling = tiling

    def build(self, steps: dict[str, nn.Module]) -> dict[str, nn.Module]:
        whole = steps[VAE_ENCODE]
        return {VAE_ENCODE_TILE: TileEncodeStep(whole, self.tiling), VAE_ENCODE_END: EncodeEndStep(whole)}

    def plan(self, state, whole: WorkPlan) -> WorkPlan:
        """`whole`, the conditioning's plan, when it is no encode or its image fits one tile; else
        the next tile, or the end once every tile is in."""
        if whole.kind != VAE_ENCODE:
            return whole
        image, latents = whole.inputs["image"], whole.inputs["latents"]
        if state.tiles is None:
            grid = self.tiling.encode_grid(*image.shape[-2:])
            if grid is None:
                return whole
            state.tiles = TileAssembly(grid)
        if state.tiles.done:
            return WorkPlan(state.request_id, VAE_ENCODE_END, {"moments": state.tiles.stitched(), "latents": latents})
        rows, cols = state.tiles.window()
        return WorkPlan(state.request_id, VAE_ENCODE_TILE, {"image": image[..., rows, cols], "latents": latents},
                        state.tiles.count)  # fmt: skip

    def take(self, state, result: StepResult) -> StepResult | None:
        """The result the conditioning takes (None while tiles are still coming)."""
        if "moments" in result:
            state.tiles.add(result["moments"], self.tiling)
            return None
        state.tiles = None
        return result
