"""Step caching at deploy scope (docs/serving.md): the engine enables methods (`step_caching_methods`,
`--cache-methods`); a request picks only among them, a card default outside them is not applied."""

import pytest
import torch
from http_helpers import KEY, httpx, live_server
from typer.testing import CliRunner

from conftest import embeds
from fvgraph.caching.methods import enabled_methods
from fvgraph.cli import app
from fvgraph.cli.options import parse_cache_methods, serving_engine
from fvgraph.engine.engine import Engine
from fvgraph.request import Request, RequestRejected

STEPS = 4
RATIOS = [1.0] + [0.99] * (STEPS - 1)
MAGCACHE = {"method": "magcache", "threshold": 0.06, "max_skip_steps": 2, "mag_ratios": RATIOS}
runner = CliRunner()


def _request(card, **fields) -> Request:
    positive, negative = embeds(1, card)
    return Request(prompt_embeds=positive, negative_prompt_embeds=negative, seed=1, output_type="latent", height=32,
                   width=32, num_frames=1, num_inference_steps=STEPS, guidance_scale=5.0, **fields)  # fmt: skip


@pytest.fixture(scope="module")
def fbcache_only(tiny_card):
    """tiny-wan (the same weights) whose card defaults to MagCache, deployed with FBCache alone enabled."""
    card = tiny_card.model_copy(update={"default_cache": Request(prompt="x", cache=MAGCACHE).cache})
    return Engine.from_card(card, device="cpu", cache_methods=["fbcache"])


def test_an_enabled_method_runs_and_reports_itself(fbcache_only):
    [result] = fbcache_only.generate([_request(fbcache_only.card, cache={"method": "fbcache", "threshold": 0.05})])
    assert result.ok, result.error
    assert result.cache["method"] == "fbcache" and result.cache["computed"] + result.cache["reused"] == 2 * STEPS


def test_a_method_not_enabled_is_rejected_naming_cache_before_any_step(fbcache_only):
    request = _request(fbcache_only.card, cache=MAGCACHE)
    with fbcache_only.counters.expect():  # not one step, eager or compiled
        with pytest.raises(RequestRejected, match=r"'magcache' is not enabled on this deployment; enabled: fbcache") as err:
            fbcache_only.start(request)
        [result] = fbcache_only.generate([request])
    assert err.value.field == "cache" and "--cache-methods" in str(err.value)
    assert result.status == "rejected" and result.error.startswith("cache: ")


def test_a_card_default_not_enabled_is_not_applied(fbcache_only, tiny_engine):
    """Requests without `cache` run exact (bit for bit the card without a default), as `cache="none"` does."""
    card = fbcache_only.card
    absent, off = fbcache_only.generate([_request(card), _request(card, cache="none")])
    [exact] = tiny_engine.generate([_request(card)])
    assert absent.ok and off.ok and exact.ok, (absent.error, off.error, exact.error)
    assert absent.cache is None and off.cache is None
    assert torch.equal(absent.latents, exact.latents) and torch.equal(off.latents, exact.latents)
    resolved = fbcache_only.loop.check_request(_request(card))
    assert resolved.caching is None and fbcache_only.loop.check_request(resolved).caching is None  # stays off


def test_cache_methods_names_the_known_methods():
    assert enabled_methods(None) == ("magcache", "teacache", "taylorseer", "fbcache")
    assert enabled_methods(["fbcache", "magcache"]) == ("magcache", "fbcache") and enabled_methods([]) == ()
    with pytest.raises(ValueError, match=r"cache_methods: 'magcach' is not a step-caching method; known methods: magcache, "
                                         r"teacache, taylorseer, fbcache"):  # fmt: skip
        Engine.from_card("tiny-wan", device="cpu", cache_methods=["magcach"])  # before any weight loads
    with pytest.raises(ValueError, match=r"cache_methods='magcache' must be a list of method names"):
        enabled_methods("magcache")


def test_the_cli_flag_parses_to_the_engine_option():
    assert parse_cache_methods(None) is None and parse_cache_methods("none") == ()
    assert parse_cache_methods(" fbcache, magcache ") == ("magcache", "fbcache")
    for text, message in [("magcache,tea", "--cache-methods='magcache,tea': cache_methods: 'tea' is not a step-caching method"),
                          (",", "--cache-methods=',' must be method names, comma separated, or 'none'")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_cache_methods(text)
    engine = serving_engine("tiny-wan", None, 0, False, False, "inductor", [], "cpu", None, False, cache_methods="teacache")
    assert engine.loop.step_caching_methods == ("teacache",)


@pytest.mark.parametrize("args, message", [
    (["--cache-methods", "magcach"], "--cache-methods='magcach': cache_methods: 'magcach' is not a step-caching method"),
    (["--cache", "fbcache", "--cache-methods", "magcache"], "--cache='fbcache': method 'fbcache' is not in --cache-methods (magcache)"),
])  # fmt: skip
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_bad_flag_exits_2_naming_it(tmp_path, command, args, message):
    out = ["-o", str(tmp_path / "v.gif")] if command == "generate" else ["-o", str(tmp_path / "out"), "-r", "-"]
    result = runner.invoke(app, [command, "-O0", *out, *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_http_a_method_not_enabled_is_a_400_naming_cache(fbcache_only, tmp_path):
    with live_server(fbcache_only, tmp_path) as (srv, url):
        response = httpx.post(url + "/v1/videos", headers={"Authorization": f"Bearer {KEY}"},
                              json={"prompt": "x", "size": "32x32", "num_inference_steps": STEPS, "cache": MAGCACHE})  # fmt: skip
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "cache", error
        assert "'magcache' is not enabled on this deployment" in error["message"] and len(srv.store) == 0
