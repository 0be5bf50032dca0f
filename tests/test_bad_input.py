"""Every bad input gets a clear error naming the field and the rule, and the engine serves the next request."""

import pytest
import torch
from pydantic import ValidationError

from fvgraph.cards import UnknownCardError
from fvgraph.engine.engine import Engine
from fvgraph.request import Request, RequestRejected

OK = {"prompt": "a kite", "seed": 0, "num_inference_steps": 2, "num_frames": 5}

FIELD_RULES = [
    ({"num_frames": 6}, "num_frames", "4k+1"),
    ({"height": 70}, "height", "multiple of 16"),
    ({"width": 33}, "width", "multiple of 16"),
    ({"num_inference_steps": 0}, "num_inference_steps", "greater than or equal to 1"),
    ({"guidance_scale": -1.0}, "guidance_scale", "greater than or equal to 0"),
    ({"guidance_scale": 100.0}, "guidance_scale", "less than or equal to 30"),
    ({"guidance_scale": float("nan")}, "guidance_scale", ""),
    ({"prompt": None}, "", "one of prompt or prompt_embeds is required"),
    ({"prompt_embeds": torch.zeros(1, 4, 32)}, "", "not both"),
    ({"prompt": None, "prompt_embeds": torch.zeros(4, 32, dtype=torch.int64)}, "prompt_embeds", "floating-point"),
    ({"prompt": None, "prompt_embeds": torch.zeros(2, 4, 32)}, "prompt_embeds", "[seq_len, dim]"),
    ({"prompt": None, "prompt_embeds": torch.full((4, 32), float("nan"))}, "prompt_embeds", "NaN"),
    ({"negative_prompt_embeds": torch.tensor([[float("inf")] * 32])}, "negative_prompt_embeds", "NaN or Inf"),
    ({"output_type": "pil"}, "output_type", ""),
    ({"num_inference_step": 4}, "num_inference_step", "Extra inputs are not permitted"),
]


@pytest.mark.parametrize("change,field,rule", FIELD_RULES)
def test_request_field_rules(change, field, rule):
    with pytest.raises(ValidationError) as info:
        Request(**{**OK, **change})
    message = str(info.value)
    assert field in message and rule in message


CARD_RULES = [
    ({"num_inference_steps": 51}, "num_inference_steps", "outside [1, 50]"),
    ({"height": 512}, "height", "maximum of 256"),
    ({"num_frames": 37}, "num_frames", "maximum of 33"),
    ({"prompt": None, "prompt_embeds": torch.zeros(4, 64)}, "prompt_embeds", "seq_len <= 32, 32"),
    ({"prompt": None, "prompt_embeds": torch.zeros(33, 32)}, "prompt_embeds", "seq_len <= 32"),
]


@pytest.mark.parametrize("change,field,rule", CARD_RULES)
def test_card_rules_reject_and_engine_serves_the_next_request(tiny_engine, change, field, rule):
    bad = Request(**{**OK, **change})
    with pytest.raises(RequestRejected) as info:
        tiny_engine.start(bad)
    assert info.value.field == field and rule in str(info.value)
    rejected, served = tiny_engine.generate([bad, Request(**OK)])
    assert rejected.status == "rejected" and field in rejected.error
    assert served.ok and served.frames.shape == (5, 64, 64, 3)


def test_a_failing_step_fails_only_its_request(tiny_engine, monkeypatch):
    """An error inside one request's step marks it failed; the request beside it completes."""
    poisoned = Request(**{**OK, "seed": 1})
    run = tiny_engine.executor.run

    def flaky(plan):
        if plan.request_id == poisoned.request_id and plan.step_index == 1:
            raise RuntimeError("simulated kernel failure")
        return run(plan)

    monkeypatch.setattr(tiny_engine.executor, "run", flaky)
    failed, served = tiny_engine.generate([poisoned, Request(**OK)])
    assert failed.status == "failed" and "simulated kernel failure" in failed.error
    assert served.ok


def test_unknown_card_suggests_the_nearest_or_lists_the_known_ones():
    with pytest.raises(UnknownCardError, match="did you mean 'tiny-wan'"):
        Engine.from_card("tiny-wna")
    with pytest.raises(UnknownCardError, match="known cards: .*tiny-wan, "):
        Engine.from_card("sdxl")


def test_unavailable_opt_level_says_which_exist():
    with pytest.raises(ValueError, match="opt_level=7"):
        Engine.from_card("tiny-wan", opt_level=7)


def test_a_duplicate_request_id_is_rejected_without_shadowing_the_first(tiny_engine):
    first = Request(**OK)
    again = Request(**{**OK, "seed": 9, "request_id": first.request_id})
    ok, dup = tiny_engine.generate([first, again])
    assert ok.status == "ok" and ok.seed == 0
    assert dup.status == "rejected" and "appears twice" in dup.error
