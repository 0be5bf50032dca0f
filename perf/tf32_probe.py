"""TF32 on the GPU, outside and inside fvgraph's fp32 context, and what it does to a Conv3d.

    python perf/tf32_probe.py            # one JSON line; on a machine without CUDA it says so and exits 0

It prints torch's TF32 switches for cuDNN convolutions and cuBLAS matmuls (the legacy `allow_tf32`
and the new `fp32_precision`) as the process starts and inside `math_mode("fp32")`
(fvgraph/runtime/tf32_switch.py). Then the Conv3d of Wan's patch embedding (16 -> 1536 channels,
kernel and stride 1x2x2) runs on an input and on the same input moved by one ulp per element,
with TF32 on and with it off: with TF32 on, inputs are rounded to 10 mantissa bits, so a one-ulp
move can flip a rounding and the outputs jump apart (~1e-3 of their size); with it off they stay
within fp32 rounding (~1e-6). Both are also set against an fp64 reference.
"""

from __future__ import annotations

import json

import torch

from fvgraph.runtime.tf32_switch import math_mode


def _switches() -> dict:
    backends = torch.backends
    state = {}
    for name, read in (("cudnn.allow_tf32", lambda: backends.cudnn.allow_tf32),
                       ("cuda.matmul.allow_tf32", lambda: backends.cuda.matmul.allow_tf32),
                       ("cudnn.conv.fp32_precision", lambda: backends.cudnn.conv.fp32_precision),
                       ("cuda.matmul.fp32_precision", lambda: backends.cuda.matmul.fp32_precision)):  # fmt: skip
        try:
            state[name] = read()
        except (AttributeError, RuntimeError) as err:  # an older torch, or the two APIs mixed
            state[name] = f"unreadable: {err}"
    return state


def _conv_probe(device: torch.device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    conv = torch.nn.Conv3d(16, 1536, kernel_size=(1, 2, 2), stride=(1, 2, 2)).to(device)
    x = torch.randn(1, 16, 5, 60, 104, generator=g).to(device)
    nudged = torch.nextafter(x, torch.full_like(x, float("inf")))  # one ulp up, every element
    with torch.no_grad():
        exact = conv.double()(x.double()).float()
        conv.float()
        out = {}
        for label, tf32 in (("tf32_on", True), ("tf32_off", False)):
            torch.backends.cudnn.allow_tf32 = tf32
            a, b = conv(x), conv(nudged)
            torch.cuda.synchronize(device)
            out[label] = {"one_ulp_input_max_abs": (a - b).abs().max().item(),
                          "vs_fp64_max_abs": (a - exact).abs().max().item()}  # fmt: skip
    out["output_max_abs"] = exact.abs().max().item()
    return out


def main() -> None:
    report = {"bench": "tf32_probe", "torch": torch.__version__, "cuda": torch.cuda.is_available(), "outside": _switches()}
    try:
        with math_mode("fp32"):
            report["inside_fp32_math"] = _switches()
    except RuntimeError as err:
        report["inside_fp32_math"] = f"refused: {err}"
    if not torch.cuda.is_available():
        report["conv3d"] = "skipped: no CUDA device"
    else:
        saved = torch.backends.cudnn.allow_tf32
        try:
            report["gpu"] = torch.cuda.get_device_name(0)
            report["conv3d"] = _conv_probe(torch.device("cuda"))
        finally:
            torch.backends.cudnn.allow_tf32 = saved
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
