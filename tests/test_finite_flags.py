"""The finite-flags pass (passes/finite_flags.py): the step graph returns, per request, whether the
outputs it computed are finite, over plain and branch-major (fused CFG) outputs, and skips inputs it
passes through."""

import torch
from torch import nn

from fvgraph.compile.step_capture import capture_step
from fvgraph.passes.base import PassContext
from fvgraph.passes.finite_flags import FINITE_OUTPUT, FiniteFlagsPass

BATCH = 4


class Step(nn.Module):
    """latents [B, 3, 2]; a fused-CFG-shaped output [2B, 5] (rows k * B + i); history passed through."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, latents, branches, history):
        return {"latents": latents * self.scale, "both": torch.log(branches), "history": history}


def _flagged(step: Step, inputs: dict) -> tuple[torch.fx.GraphModule, list[str]]:
    cap = capture_step("denoise", step, inputs)
    ctx = PassContext(root=step, example_args=cap.example_args, num_params=cap.num_params, batch=BATCH)
    gm = FiniteFlagsPass()(cap.gm, ctx)
    return gm, cap.output_names + ctx.extra_outputs


def test_each_request_is_flagged_by_its_own_rows_of_every_computed_output():
    step = Step()
    inputs = {"latents": torch.randn(BATCH, 3, 2), "branches": torch.rand(2 * BATCH, 5) + 0.5,
              "history": torch.randn(BATCH, 3, 2)}  # fmt: skip
    gm, names = _flagged(step, inputs)
    assert names == ["latents", "both", "history", FINITE_OUTPUT]
    inputs["latents"][2, 1, 0] = float("inf")  # request 2, through a plain output
    inputs["branches"][BATCH + 1, 3] = -1.0  # request 1's second branch row: log(-1) is NaN
    inputs["history"][0, 0, 0] = float("nan")  # passed through: the step did not make it, not checked
    with torch.no_grad():
        *outs, flags = gm(*step.parameters(), *inputs.values())
    reference = [
        bool(torch.isfinite(outs[0][i]).all() and torch.isfinite(outs[1].view(2, BATCH, 5)[:, i]).all()) for i in range(BATCH)
    ]  # fmt: skip
    assert reference == [True, False, False, True]
    assert flags.dtype == torch.bool and flags.tolist() == reference


def test_a_step_that_only_passes_inputs_through_gets_no_flags():
    class PassThrough(nn.Module):
        def forward(self, latents):
            return {"latents": latents}

    gm, names = _flagged(PassThrough(), {"latents": torch.randn(BATCH, 2)})
    assert names == ["latents"]
