"""Step caching as users choose it: the METHOD[:k=v,...] text, a card's default and how a request opts
out, the HTTP body field, and `--cache` on the command line."""

import json

import pytest
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from fvgraph.card import ModelCard
from fvgraph.cli import app
from fvgraph.caching.settings import NoCache, parse_cache_text
from fvgraph.caching.methods import parse_cache_settings
from fvgraph.caching.mag_cache import MagCacheSettings
from fvgraph.request import Request, RequestRejected
from fvgraph.engine.engine import Engine
from fvgraph.serving.openai_requests import VideoBody, parse_body, video_request
from conftest import embeds

STEPS = 6
RATIOS = [1.0] + [0.99] * (STEPS - 1)
TEXT = f"magcache:threshold=0.06,max_skip_steps=2,mag_ratios={RATIOS}".replace(" ", "")
runner = CliRunner()


def _request(card, seed: int, **fields) -> Request:
    positive, negative = embeds(seed, card)
    return Request(prompt_embeds=positive, negative_prompt_embeds=negative, seed=seed, output_type="latent", height=64,
                   width=64, num_frames=5, num_inference_steps=STEPS, guidance_scale=5.0, **fields)  # fmt: skip


def test_the_text_form_parses_to_the_same_settings_and_errors_as_the_dict():
    as_dict = {"method": "magcache", "threshold": 0.06, "max_skip_steps": 2, "mag_ratios": RATIOS}
    assert parse_cache_text(TEXT) == as_dict
    assert parse_cache_settings(TEXT) == parse_cache_settings(as_dict) == MagCacheSettings(**as_dict)
    assert parse_cache_settings('{"method": "magcache", "mag_ratios": [1, 0.5]}').mag_ratios == (1.0, 0.5)
    assert parse_cache_settings("none") == parse_cache_settings({"method": "none"}) == NoCache()
    for text, message in [("magcach", r"cache.method='magcach' is not a known method; known methods: magcache"),
                          ("magcache:tresh=0.1", r"cache.tresh: Extra inputs are not permitted"),
                          ("magcache:threshold=-1", r"cache.threshold: Input should be greater than or equal to 0"),
                          ("magcache:threshold", r"'threshold' must be key=value"),
                          ("none:threshold=0.1", r"cache.threshold: method 'none' \(caching off\) takes no settings")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_cache_settings(text)
        with pytest.raises(ValidationError, match=message):  # a Request says the same
            Request(prompt="x", cache=text)
    with pytest.raises(ValidationError, match="cache must be a dict with a 'method' key"):
        Request(prompt="x", cache=3)


def test_a_card_default_validates_naming_the_field(tiny_card):
    with pytest.raises(ValidationError, match=r"default_cache\n.*cache.method='fbcach' is not a known method"):
        ModelCard.model_validate({**tiny_card.model_dump(), "default_cache": {"method": "fbcach"}})
    card = ModelCard.model_validate({**tiny_card.model_dump(), "default_cache": TEXT})
    assert card.default_cache == parse_cache_settings(TEXT)


@pytest.fixture(scope="module")
def default_engine(tiny_card):
    """tiny-wan (the same weights) with a MagCache default that reuses at some steps."""
    card = ModelCard.model_validate({**tiny_card.model_dump(), "default_cache": TEXT})
    return Engine.from_card(card, device="cpu")


def test_the_card_default_applies_to_a_request_without_cache_and_none_opts_out(default_engine, tiny_engine):
    card = default_engine.card
    absent, opted_out, explicit = _request(card, 1), _request(card, 1, cache="none"), _request(card, 1, cache=f"{TEXT},threshold=0")
    assert absent.resolve(card).cache == card.default_cache
    assert opted_out.resolve(card).cache == NoCache() and opted_out.resolve(card).caching is None
    assert opted_out.resolve(card).resolve(card).caching is None  # resolving again does not bring the default back
    results = default_engine.generate([absent, opted_out, explicit])
    assert all(r.ok for r in results), [r.error for r in results]
    default, off, own = ({k: r.cache[k] for k in ("method", "computed", "reused")} if r.cache else r.cache for r in results)
    assert default == {"method": "magcache", "computed": 4, "reused": 8}  # steps 0, 3 keep (max_skip_steps 2); the rest reuse
    assert off is None
    assert own == {"method": "magcache", "computed": 2 * STEPS, "reused": 0}  # threshold 0: nothing reuses
    [plain] = tiny_engine.generate([_request(card, 1)])  # the card without a default, same weights
    assert plain.cache is None
    assert torch.equal(results[1].latents, plain.latents) and torch.equal(results[2].latents, plain.latents)
    assert not torch.equal(results[0].latents, plain.latents)


def test_the_http_body_takes_cache_as_json_or_form_text(tiny_card):
    def parsed(cache):
        body = parse_body(VideoBody, {"prompt": "a fox", "size": "64x64", "num_frames": 5, "cache": cache})
        return video_request(body, tiny_card, "video_1", 1000, 4).request

    assert parsed(TEXT).cache == parsed({"method": "magcache", "threshold": 0.06, "max_skip_steps": 2, "mag_ratios": RATIOS}).cache
    assert parsed("none").cache == NoCache()
    with pytest.raises(RequestRejected, match=r"cache: Value error, cache.method='teacach' is not a known method") as err:
        parsed("teacach:threshold=0.1")
    assert err.value.field == "cache"


def test_generate_takes_cache_and_reports_what_ran(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default calibration root is relative: nothing calibrated here
    base = ["generate", "-p", "a fox", "--steps", str(STEPS), "--frames", "1", "-O0", "-o", str(tmp_path / "v.gif")]
    result = runner.invoke(app, [*base, "--cache", TEXT])
    assert result.exit_code == 0, result.output
    assert "cache magcache: 4 denoiser calls computed, 8 reused" in result.output
    bad = runner.invoke(app, [*base, "--cache", "magcache:tresh=1"])
    assert bad.exit_code == 2
    assert "--cache: cache method 'magcache': cache.tresh: Extra inputs are not permitted" in " ".join(bad.output.split())
    uncalibrated = runner.invoke(app, [*base, "--cache", "magcache"])
    assert uncalibrated.exit_code == 2, uncalibrated.output
    assert "cache.mag_ratios: not given, and none calibrated for card 'tiny-wan'" in " ".join(uncalibrated.output.split())


def test_serve_takes_cache_as_the_default_of_requests_without_one(tmp_path):
    lines = tmp_path / "requests.jsonl"
    common = {"prompt": "a fox", "num_inference_steps": STEPS, "num_frames": 1, "output_type": "latent"}
    lines.write_text("\n".join(json.dumps({**common, **extra}) for extra in
                               ({"request_id": "default"}, {"request_id": "off", "cache": "none"})) + "\n")  # fmt: skip
    result = runner.invoke(app, ["serve", "-O0", "-r", str(lines), "-o", str(tmp_path / "out"), "--cache", TEXT])
    assert result.exit_code == 0, result.output
    answers = {a["request_id"]: a for a in map(json.loads, (t for t in result.stdout.splitlines() if t.startswith("{")))}
    assert answers["default"]["status"] == answers["off"]["status"] == "ok"
    assert answers["default"]["cache"]["reused"] == 8 and "cache" not in answers["off"]


def test_a_resumed_state_must_hold_complete_active_settings(tiny_engine):
    state = tiny_engine.start(_request(tiny_engine.card, 2, cache=TEXT))
    tiny_engine.step(state)
    for bad in ({"method": "none"}, {"method": "magcache", "threshold": 0.1}):
        state.caching.settings = parse_cache_settings(bad)
        with pytest.raises(ValueError, match=r"caching.settings: must be complete settings of a caching method"):
            tiny_engine.resume(state)


def test_after_a_cached_warmup_a_frozen_generate_compiles_nothing(tmp_path):
    """`fvgraph warmup --cache` stores the keep and reuse kinds at every bucket; `generate` with the
    same --cache and --fail-on-recompile then serves two cached requests batched from the store."""
    compiled = ["-O1", "--compile-backend", "aot_eager", "--cache-dir", str(tmp_path / "cc"), "--cache", TEXT]
    shape = ["--frames", "1", "--height", "32", "--width", "32"]
    warm = runner.invoke(app, ["warmup", *compiled, "--buckets", "1,2", "--shape", "1x32x32", "--steps", str(STEPS)])
    assert warm.exit_code == 0, warm.output
    assert "4 step graphs" in warm.output  # denoise_cfg_keep and denoise_cfg_reuse at batch 1 and 2
    served = runner.invoke(app, ["generate", *compiled, "--fail-on-recompile", *shape, "--steps", str(STEPS),
                                 "-p", "a fox", "-p", "a hare", "-o", str(tmp_path / "v.gif")])  # fmt: skip
    assert served.exit_code == 0, served.output
    assert served.output.count("reused") == 2 and "compiles: 0" in served.output
