"""fvgraph.kernels: every op against its torch reference, the references against diffusers' Wan math,
every op inside torch.compile(fullgraph=True), the Triton kernel on the CPU under TRITON_INTERPRET=1, and
the SDPA backend table.

The Triton checks run in ONE subprocess (this file run as a script, with TRITON_INTERPRET=1 set before
anything imports triton), whose JSON results the parametrized `test_triton_interpreter` cases read:
the interpreter setting must be in place before triton is imported, which a pytest process that
already imported torch and friends cannot promise.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fvgraph.kernels import attention as attn_mod
from fvgraph.kernels.fp8_linear import (
    FP8_DTYPE,
    fp8_linear_reference,
    fp8_linear_supported,
    quantize_rows_fp8,
    quantize_weight_fp8,
)
from fvgraph.kernels.norm_modulate import modulated_fp32, norm_modulate_quant_reference

ops = torch.ops.fvgraph
EPS = 1e-6
# FP8 e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 = 6.25% of a value, on each operand. Against the
# unquantized F.linear the errors of K products partly cancel; over the output tensor the largest error
# is a few % of the largest output (measured ~2%), so 5% of max|y| bounds it with margin, and the
# cosine similarity stays far above 0.99.
FP8_MAX_REL = 0.05
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}  # fmt: skip


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _norm_inputs(dtype, per_token: bool, b=2, s=5, d=48, seed=0):
    g = _gen(seed)
    x = (torch.randn(b, s, d, generator=g) * 3 + 1).to(dtype)
    mod_shape = (b, s, d) if per_token else (b, 1, d)
    return x, torch.randn(*mod_shape, generator=g), torch.randn(*mod_shape, generator=g) * 0.2


# ---- FP8 linear ---------------------------------------------------------------------------------


def test_quantize_weight_per_channel():
    w = torch.randn(32, 64, generator=_gen()) * torch.logspace(-3, 1, 32).unsqueeze(1)  # channels 10^4 apart
    w[3] = 0  # an all-zero channel must not produce NaN
    w_q, w_s = quantize_weight_fp8(w)
    assert w_q.dtype == FP8_DTYPE and w_q.shape == (32, 64) and w_q.is_contiguous()
    assert w_s.dtype == torch.float32 and w_s.shape == (32,)
    assert torch.equal(w_q.float().abs().amax(1)[[0, 1, 31]], torch.full((3,), 448.0))  # each row uses the full range
    err = (w_q.float() * w_s[:, None] - w).abs() / w.abs().amax(1, keepdim=True).clamp(min=1e-30)
    assert err.max() <= 2**-4 + 1e-6  # half an e4m3 ulp at the top of each row's range, per channel
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantize_weight_fp8(torch.randn(2, 3, 4))


def test_quantize_rows_scales_each_row():
    x = torch.randn(2, 3, 64, generator=_gen()).bfloat16()
    x_q, x_s = quantize_rows_fp8(x)
    assert x_q.shape == x.shape and x_q.dtype == FP8_DTYPE and x_s.shape == (2, 3, 1) and x_s.dtype == torch.float32
    torch.testing.assert_close(x_s, x.float().abs().amax(-1, keepdim=True) / 448)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fp8_linear_matches_reference_and_linear(dtype, with_bias):
    g = _gen(1)
    x = torch.randn(2, 7, 64, generator=g).to(dtype)  # leading dims [2, 7]
    w, bias = torch.randn(48, 64, generator=g) * 0.1, torch.randn(48, generator=g) if with_bias else None
    w_q, w_s = quantize_weight_fp8(w)
    y = ops.fp8_linear(x, w_q, w_s, None if bias is None else bias.to(dtype))
    assert y.shape == (2, 7, 48) and y.dtype == dtype
    x_q, x_s = quantize_rows_fp8(x)
    expected = fp8_linear_reference(x_q, x_s, w_q, w_s, None if bias is None else bias.to(dtype))
    torch.testing.assert_close(y.float(), expected, **TOL[dtype])  # same quantized operands: only out rounding
    exact = F.linear(x.float(), w, bias)
    assert F.cosine_similarity(y.float().flatten(), exact.flatten(), dim=0) > 0.99
    assert (y.float() - exact).abs().max() / exact.abs().max() < FP8_MAX_REL


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_prequant_equals_fp8_linear(out_dtype):
    g = _gen(2)
    x = torch.randn(3, 5, 32, generator=g).to(out_dtype)
    w, bias = torch.randn(16, 32, generator=g), torch.randn(16, generator=g)
    w_q, w_s = quantize_weight_fp8(w)
    x_q, x_s = quantize_rows_fp8(x)
    y = ops.fp8_linear_prequant(x_q, x_s, w_q, w_s, bias, out_dtype)
    assert y.dtype == out_dtype and y.shape == (3, 5, 16)
    torch.testing.assert_close(y, ops.fp8_linear(x, w_q, w_s, bias), rtol=0, atol=0)


def test_fp8_linear_rejects_mismatched_operands():
    w_q, w_s = quantize_weight_fp8(torch.randn(16, 32))
    with pytest.raises(ValueError, match="K=24"):
        ops.fp8_linear(torch.randn(2, 24), w_q, w_s, None)
    with pytest.raises(ValueError, match="w_fp8 must be"):
        ops.fp8_linear(torch.randn(2, 32), w_q.float(), w_s, None)
    assert fp8_linear_supported(torch.empty(16, 32)) and not fp8_linear_supported(torch.empty(16, 40 + 1))


# ---- norm_modulate_quant: reference vs diffusers, op vs reference ------------------------------------


@pytest.mark.parametrize("per_token", [False, True])
def test_modulated_reference_is_wan_block_math(per_token):
    from diffusers.models.normalization import FP32LayerNorm

    x, shift, scale = _norm_inputs(torch.bfloat16, per_token)
    norm1 = FP32LayerNorm(x.shape[-1], EPS, elementwise_affine=False)  # WanTransformerBlock.norm1
    wan = (norm1(x.float()) * (1 + scale) + shift).type_as(x)
    assert torch.equal(modulated_fp32(x, shift, scale, EPS).type_as(x), wan)


@pytest.mark.parametrize("per_token", [False, True])
def test_norm_modulate_quant_dequantizes_to_modulated(per_token):
    x, shift, scale = _norm_inputs(torch.bfloat16, per_token)
    x_q, x_s = ops.norm_modulate_quant(x, shift, scale, EPS)
    assert x_q.dtype == FP8_DTYPE and x_q.shape == x.shape and x_s.shape == (*x.shape[:2], 1)
    ref_q, ref_s = norm_modulate_quant_reference(x, shift, scale, EPS)
    assert torch.equal(x_q.float(), ref_q.float()) and torch.equal(x_s, ref_s)
    y = modulated_fp32(x, shift, scale, EPS)
    assert ((x_q.float() * x_s - y).abs() <= x_s * 16 + 1e-6).all()  # half an ulp at the top of [256, 448]


def test_norm_modulate_quant_rejects_bad_modulation_shape():
    x, shift, scale = _norm_inputs(torch.float32, False)
    with pytest.raises(ValueError, match="norm_modulate_quant: shift of shape"):
        ops.norm_modulate_quant(x, shift[..., :7], scale, EPS)


# ---- attention --------------------------------------------------------------------------------------


def test_sdpa_backend_table(monkeypatch):
    B = torch.nn.attention.SDPBackend
    assert attn_mod.sdpa_backends(14000, 128, torch.bfloat16, "cpu") == [B.FLASH_ATTENTION, B.MATH]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert attn_mod.sdpa_backends(14000, 128, torch.bfloat16, "cuda:0")[0] == B.CUDNN_ATTENTION  # measured: 595 vs 365
    assert attn_mod.sdpa_backends(1280, 128, torch.bfloat16, "cuda:0")[0] == B.FLASH_ATTENTION  # short: flash
    assert attn_mod.sdpa_backends(14000, 256, torch.bfloat16, "cuda:0")[0] == B.FLASH_ATTENTION  # unmeasured head_dim
    assert attn_mod.sdpa_backends(14000, 128, torch.float32, "cuda:0")[0] == B.EFFICIENT_ATTENTION  # no fp32 flash
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert attn_mod.sdpa_backends(14000, 128, torch.bfloat16, "cuda:0")[0] == B.FLASH_ATTENTION  # not measured on A100


# ---- every op inside torch.compile(fullgraph=True) + opcheck ------------------------------------------


def _op_cases():
    w_q, w_s = quantize_weight_fp8(torch.randn(16, 32, generator=_gen(4)))
    x = torch.randn(2, 3, 32, generator=_gen(5))
    x_q, x_s = quantize_rows_fp8(x)
    xn, shift, scale = _norm_inputs(torch.float32, True)
    return {
        "fp8_linear": (ops.fp8_linear.default, (x, w_q, w_s, torch.randn(16))),
        "fp8_linear_prequant": (ops.fp8_linear_prequant.default, (x_q, x_s, w_q, w_s, None, torch.bfloat16)),
        "norm_modulate_quant": (ops.norm_modulate_quant.default, (xn, shift, scale, EPS)),
    }


@pytest.mark.parametrize("name", list(_op_cases()))
def test_op_compiles_fullgraph_and_matches_eager(name):
    op, args = _op_cases()[name]
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: op(*a), fullgraph=True, backend="aot_eager")
    eager, got = op(*args), compiled(*args)
    for e, c in zip(eager if isinstance(eager, tuple) else (eager,), got if isinstance(got, tuple) else (got,)):
        assert c.dtype == e.dtype and c.shape == e.shape
        assert torch.equal(c.float(), e.float())


@pytest.mark.parametrize("name", list(_op_cases()))
def test_opcheck(name):
    """Schema, fake (register_fake) shapes/dtypes vs the real op, and AOT dispatch."""
    op, args = _op_cases()[name]
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    if any(isinstance(a, torch.Tensor) and a.dtype == FP8_DTYPE for a in args):
        utils = utils[1:]  # test_schema's mutation check multiplies inputs, which CPU fp8 tensors cannot do
    torch.library.opcheck(op, args, test_utils=utils)


# ---- Triton kernels under the interpreter (CPU) -------------------------------------------------------

TRITON_CHECKS = [f"norm_modulate_quant-{d}" for d in ("float32", "float16")]


def _triton_results() -> dict:
    """name -> error message or "" (pass), for every Triton kernel vs its reference. Needs TRITON_INTERPRET=1."""
    from fvgraph.kernels.norm_modulate_triton import norm_modulate_quant_triton

    results = {}
    for dname in ("float32", "float16"):
        dtype = getattr(torch, dname)
        cases = {
            "norm_modulate_quant": [(norm_modulate_quant_triton(*a, EPS), norm_modulate_quant_reference(*a, EPS))
                                    for a in (_norm_inputs(dtype, False), _norm_inputs(dtype, True, s=3, d=40))],
        }  # fmt: skip
        for kernel, pairs in cases.items():
            try:
                for got, ref in pairs:
                    for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
                        assert g.dtype == r.dtype and g.shape == r.shape, f"{g.dtype}{list(g.shape)} vs {r.dtype}{list(r.shape)}"
                        torch.testing.assert_close(g.float(), r.float(), **TOL[dtype])
                results[f"{kernel}-{dname}"] = ""
            except AssertionError as e:
                results[f"{kernel}-{dname}"] = str(e)[:2000]
    return results


@pytest.fixture(scope="module")
def triton_interpreter_results():
    from fvgraph.kernels._triton import triton_available

    if not triton_available():
        pytest.skip("triton is not importable: the Triton kernels cannot run (their torch references are tested above)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", TRITON_CHECKS)
def test_triton_interpreter(triton_interpreter_results, check):
    assert check in triton_interpreter_results, f"{check} did not run: {sorted(triton_interpreter_results)}"
    assert triton_interpreter_results[check] == "", triton_interpreter_results[check]


# ---- on CUDA: the Triton kernel and the FP8 GEMM at model-like widths ------------------


def _cuda_triton():
    from fvgraph.kernels._triton import triton_available

    if not triton_available():
        pytest.skip("triton is not importable on this CUDA machine: the ops run their references")


@pytest.mark.gpu
@pytest.mark.parametrize("per_token", [False, True])
def test_cuda_norm_modulate_quant_triton(per_token):
    _cuda_triton()
    x, shift, scale = (t.cuda() for t in _norm_inputs(torch.bfloat16, per_token, b=2, s=300, d=1536))
    x_q, x_s = ops.norm_modulate_quant(x, shift, scale, EPS)
    ref_q, ref_s = norm_modulate_quant_reference(x, shift, scale, EPS)
    torch.testing.assert_close(x_s, ref_s, rtol=1e-5, atol=0)
    # The same value rounds to the same e4m3 code unless a 1-ulp fp32 difference sits on a rounding tie.
    assert (x_q.float() != ref_q.float()).float().mean() < 1e-3


@pytest.mark.gpu
def test_cuda_fp8_linear():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 300, 1536, device="cuda", generator=g).bfloat16()
    w = torch.randn(8960, 1536, device="cuda", generator=g) * 0.02
    bias = torch.randn(8960, device="cuda", generator=g).bfloat16()
    w_q, w_s = quantize_weight_fp8(w)
    y = ops.fp8_linear(x, w_q, w_s, bias)
    x_q, x_s = quantize_rows_fp8(x)
    torch.testing.assert_close(y.float(), fp8_linear_reference(x_q, x_s, w_q, w_s, bias), rtol=2e-2, atol=2e-2)
    exact = F.linear(x.float(), w, bias.float())
    assert F.cosine_similarity(y.float().flatten(), exact.flatten(), dim=0) > 0.99
    assert (y.float() - exact).abs().max() / exact.abs().max() < FP8_MAX_REL
    assert ops.fp8_linear(x.float(), w_q, w_s, bias).dtype == torch.float32  # bf16 GEMM, cast back


@pytest.mark.gpu
def test_cuda_ops_replay_in_a_cuda_graph():
    """The quantize pass's chain (prologue + FP8 quantization -> FP8 linear) captured once and replayed on new inputs."""
    x, shift, scale = (t.cuda() for t in _norm_inputs(torch.bfloat16, False, b=2, s=64, d=256))
    w_q, w_s = quantize_weight_fp8(torch.randn(256, 256, device="cuda") * 0.05)

    def chain():
        x_q, x_s = ops.norm_modulate_quant(x, shift, scale, EPS)
        return ops.fp8_linear_prequant(x_q, x_s, w_q, w_s, None, torch.bfloat16)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()  # warm up (Triton compiles, cuBLASLt picks its algorithm) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, chain(), rtol=0, atol=0)


if __name__ == "__main__":  # the subprocess of triton_interpreter_results
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (see the module docstring)"
    print(json.dumps(_triton_results()))
