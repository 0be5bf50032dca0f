"""How much memory a request holds while it is served, estimated from its shapes before it runs.

A request that is running holds, besides the weights and compiled graphs every request shares:

    loop_state      its latents, the sampler's history (carry) and its text embeddings (both CFG branches)
    batch_lane      its row of the bucket's static buffers: the same step inputs again, plus the
                    hoisted text K/V of every block (Wan 1.3B with CFG: about 190 MB)
    activations     its rows of one denoise forward (both branches), times the worst padding of the
                    batch buckets (with 1, 2, 4, 8 five requests run at 8: a factor of 1.6)
    decoded_frames  the decoded video: the float32 copies alive while it is assembled and rescaled,
                    and the uint8 frames
    vae_decode      the VAE decoder's working set for one chunk of frames at full resolution, on the
                    engine's device (on a CPU, convolutions unfold their input: see below); with
                    `vae_tiling`, for one chunk of one tile instead
    vae_tile_rows   with `vae_tiling`: the two rows of decoded tiles a tiled decode holds while it
                    blends (fvgraph/loops/tiled_coding.py)

Every part is an estimate from shapes and named factors, not a measurement: it is what
`--memory-budget` is charged with, so a request that could never fit is refused at once, and requests
that do not fit now wait until others end. The parts are summed although the denoise activations and
the VAE decode never peak together, so the sum errs high. On a CPU, tests/test_admission.py holds the
estimate of a tiny-wan request to at least its measured peak resident-memory growth and at most 3x it
plus the fixed part below, which a small decode may or may not take (measured there: 5x32x32,
9x128x128 and 5x256x256 with CFG). The CUDA factors are not measured yet.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from fvgraph.request import Request

# Feature maps of the widest layer alive at the peak of one DiT block: the FFN hidden state plus
# q, k, v, the attention output and the residual stream (in inner-dim units).
DIT_LIVE_INNER_MAPS = 6
# Feature maps of the decoder's top-resolution width alive at once while it decodes one chunk
# (residual blocks keep input, two convolutions and the causal cache of the previous chunk).
VAE_LIVE_MAPS = 8
# On a CPU, bytes per top-width channel and output position of a chunk: a 3x3x3 convolution there
# unfolds its input into 27 columns per position (im2col), beside the padded input, the causal caches
# of every full-resolution convolution and the upsampler's maps; plus a fixed part (convolution
# scratch space, the allocator's arenas) that dominates small decodes. Measured peak RSS growth of
# whole tiny-wan requests (fresh process each, CFG): 20 MB at 5x32x32, 54 at 5x64x64, 138-166 at
# 9x128x128, 342-460 at 256x256 (5 to 33 frames); these factors come out 1.2x to 2.1x of it. The
# allocator's part varies from process to process: the same tiled tiny-wan request at 5x256x256
# (tests/test_vae_tiling.py) grew 135 to 230 MB over six fresh processes, so the fixed part is 64 MB,
# which keeps its estimate (247 MB) above the largest.
VAE_CPU_BYTES_PER_CHANNEL = 300
VAE_CPU_FIXED_BYTES = 64 << 20
# Float32 copies of the whole decoded video alive at once: the decoder's growing concatenation (old
# and new), the clamp, the rescale to [0, 1], and the host copy the frames are made from.
VIDEO_FLOAT_COPIES = 4
# On a GPU the budget is this share of the memory free after the weights loaded; the rest is left to
# the graph pools, the allocator's fragmentation and the CUDA context.
CUDA_BUDGET_SHARE = 0.8
# On a CPU the budget is this share of physical memory.
CPU_BUDGET_SHARE = 0.5


@dataclass(frozen=True)
class Reservation:
    """The bytes one request is charged, by part (see the module docstring)."""

    request_id: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


class MemoryModel:
    """Reads the facts an estimate needs from an engine's loaded components, once."""

    def __init__(self, engine):
        loop, card = engine.loop, engine.card
        dit = loop.components.transformer.config
        vae = loop.components.vae.config
        self.dit_bytes = loop.components.transformer.dtype.itemsize
        self.inner = dit.num_attention_heads * dit.attention_head_dim
        # Wan's configs name the FFN width; FLUX's blocks are 4x wide and come as double + single stream.
        self.ffn = dit.get("ffn_dim") or 4 * self.inner
        self.layers = dit.num_layers + dit.get("num_single_layers", 0)
        self.patch = engine.facts.patch_size
        self.channels = loop.latent_channels
        self.temporal_scale, self.spatial_scale = loop.temporal_scale, loop.spatial_scale
        self.text_len, self.text_dim = card.shapes.text_len, engine.facts.text_dim
        self.carry = len(loop.sampler.initial_carry(torch.zeros(1)))
        # The decoder's channels at full resolution: Wan's VAE config, or an image VAE's first level.
        self.vae_top = vae.base_dim * vae.dim_mult[0] if "base_dim" in vae else vae.block_out_channels[0]
        cpu = loop.components.device.type == "cpu"
        self.vae_bytes_per_channel = VAE_CPU_BYTES_PER_CHANNEL if cpu else VAE_LIVE_MAPS * 4
        self.vae_fixed = VAE_CPU_FIXED_BYTES if cpu else 0
        self.tiling = engine.loop.decoding.tiling  # None: the VAE decodes whole
        buckets = engine.buckets.batch_sizes
        self.padding = max(engine.buckets.batch_for(n) / n for n in range(1, buckets[-1] + 1))

    def estimate(self, request: Request) -> Reservation:
        """`request` resolved against the card (shapes filled in)."""
        frames, height, width = request.num_frames, request.height, request.width
        branches = 2 if request.do_cfg else 1
        latent_frames = (frames - 1) // self.temporal_scale + 1
        h, w = height // self.spatial_scale, width // self.spatial_scale
        latent = self.channels * latent_frames * h * w * 4  # float32
        embeds = branches * self.text_len * self.text_dim * self.dit_bytes
        tokens = latent_frames * (h // self.patch[1]) * (w // self.patch[2]) // self.patch[0]
        text_kv = branches * self.layers * 2 * self.text_len * self.inner * self.dit_bytes
        forward = branches * tokens * (self.ffn + DIT_LIVE_INNER_MAPS * self.inner) * self.dit_bytes
        chunk = min(frames, self.temporal_scale)
        grid = None if self.tiling is None else self.tiling.decode_grid(h, w)
        decode_h, decode_w = height, width  # what one decoder pass covers
        if grid is not None:
            decode_h = (min(grid.rows[0].stop, h) - grid.rows[0].start) * self.spatial_scale
            decode_w = (min(grid.cols[0].stop, w) - grid.cols[0].start) * self.spatial_scale
        parts = {
            "loop_state": (1 + self.carry) * latent + embeds,
            "batch_lane": (1 + self.carry) * latent + embeds + text_kv,
            "activations": int(forward * self.padding),
            "decoded_frames": frames * height * width * 3 * (4 * VIDEO_FLOAT_COPIES + 1),
            "vae_decode": self.vae_fixed + self.vae_bytes_per_channel * self.vae_top * chunk * decode_h * decode_w,
        }
        if grid is not None:  # two rows of float32 tiles, each row as wide as its tiles side by side
            parts["vae_tile_rows"] = 2 * frames * 3 * 4 * decode_h * decode_w * len(grid.cols)
        return Reservation(request.request_id, parts)


def default_budget(engine) -> int:
    """The memory requests may reserve when no `--memory-budget` is given (see the shares above). With
    offload, the most weight bytes it brings onto the device at once (`engine.residency.planned_peak`)
    are taken off, less on a GPU what is there already when the free memory is read (block offload's
    resident weights and slots, `held_from_build`); a budget that leaves nothing is refused."""
    device = engine.loop.components.device
    weights = 0 if engine.residency is None else engine.residency.planned_peak
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * CUDA_BUDGET_SHARE)
        weights -= 0 if engine.residency is None else engine.residency.held_from_build
    else:
        budget = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * CPU_BUDGET_SHARE)
    if budget - weights <= 0:
        raise ValueError(f"offload: the weights it brings onto the device at once ({weights / 2**30:.2f} GiB) leave no "
                         f"memory for requests in the default budget of {budget / 2**30:.2f} GiB")  # fmt: skip
    return budget - weights
