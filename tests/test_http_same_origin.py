"""Hardening round three, HTTP: what a web page elsewhere cannot make a browser do to a local server
(fvgraph/serving/http_same_origin.py), and the admin key, through the real server on a loopback port.
Each test failed on the code before the fix: the rebinding Host was answered, the cross-site posts
reached their routes, and the API key opened the admin actions whatever --admin-api-key said."""

from __future__ import annotations

import pytest

from fvgraph.adapters.slots import LoraSlots
from fvgraph.engine.engine import Engine
from fvgraph.serving.http_app import HttpSettings
from fvgraph.serving.http_same_origin import default_allowed_hosts
from fvgraph.serving.http_server import HttpServer
from http_helpers import httpx
from lora_files import peft_lora


@pytest.fixture(scope="module")
def engine():
    return Engine.from_card("tiny-wan", device="cpu")


@pytest.fixture(scope="module")
def lora_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    peft_lora(folder / "kv", 3, ["attn2.to_k", "attn2.to_v"])
    return folder


def _server(engine, tmp_path, api_key=None, allowed_hosts=(), origins=()):
    settings = HttpSettings(api_key=api_key, allowed_origins=origins,
                            allowed_hosts=default_allowed_hosts("127.0.0.1", allowed_hosts))  # fmt: skip
    return HttpServer(engine, settings, tmp_path / "store", port=0)


def test_a_loopback_server_answers_only_loopback_host_names(engine, tmp_path):
    with _server(engine, tmp_path, allowed_hosts=("fv.internal",)).running() as url:
        port = url.rsplit(":", 1)[1]
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "fv.internal"):
            assert httpx.get(url + "/v1/videos", headers={"Host": host}).status_code == 200, host
        for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.attacker.example"):
            answer = httpx.get(url + "/v1/videos", headers={"Host": host})
            assert answer.status_code == 421 and answer.json()["error"]["code"] == "host_not_allowed", host
            assert "--allowed-hosts" in answer.json()["error"]["message"]


def test_default_allowed_hosts_follow_the_bind_address():
    assert default_allowed_hosts("127.0.0.1", ()) == ("localhost", "127.0.0.1", "[::1]")
    assert default_allowed_hosts("::1", ()) == ("localhost", "127.0.0.1", "[::1]")
    assert default_allowed_hosts("0.0.0.0", ()) is None  # bound for the network: names are the operator's
    assert default_allowed_hosts("0.0.0.0", ("Video.Example",)) == ("localhost", "127.0.0.1", "[::1]", "video.example")


def test_a_cross_site_page_cannot_write_to_a_keyless_server(engine, tmp_path):
    with _server(engine, tmp_path, origins=("http://ok.example",)).running() as url:
        own = url  # the playground's own pages: Origin equals the server's scheme://host:port
        evil = {"Origin": "http://evil.example"}
        plain = {"Content-Type": "text/plain"}
        body = '{"name": "x", "path": "/etc/passwd"}'
        # text/plain needs no preflight: before, /v1/loras parsed it as JSON and opened the path
        crossed = httpx.post(url + "/v1/loras", content=body, headers={**evil, **plain})
        assert crossed.status_code == 403 and crossed.json()["error"]["code"] == "cross_origin"
        answer = httpx.post(url + "/v1/loras", content=body, headers=plain)
        assert answer.status_code == 415 and "application/json" in answer.json()["error"]["message"]
        # an HTML form posting a video from another site
        form = httpx.post(url + "/v1/videos", data={"prompt": "a fox", "seconds": "1"}, headers=evil)
        assert form.status_code == 403 and form.json()["error"]["code"] == "cross_origin"
        assert httpx.delete(url + "/v1/videos/video_x", headers=evil).status_code == 403
        assert httpx.get(url + "/v1/videos", headers=evil).status_code == 200  # reading is CORS's business
        # its own pages, a listed origin, and clients that are no browser (no Origin) still write
        for headers in ({"Origin": own}, {"Origin": "http://ok.example"}, {}):
            answer = httpx.post(url + "/v1/loras", json={"name": "x", "path": "/nonexistent.safetensors"}, headers=headers)
            assert answer.json()["error"]["code"] == "lora_dir_unset", (headers, answer.text)  # past the guard, to the route


def test_with_an_api_key_json_routes_still_take_json_only(engine, tmp_path):
    with _server(engine, tmp_path, api_key="k").running() as url:
        key = {"Authorization": "Bearer k"}
        answer = httpx.post(url + "/v1/images/generations", content='{"prompt": "a"}',
                            headers={**key, "Content-Type": "text/plain", "Origin": "http://evil.example"})  # fmt: skip
        assert answer.status_code == 415


def test_an_admin_key_alone_opens_the_admin_actions(engine, tmp_path, lora_folder):
    """Issue 51's fault 14: with --admin-api-key, loading and unloading adapters and sleep / wake take
    that key alone; the API key still generates, and without an admin key the API key does both."""
    settings = HttpSettings(api_key="user", admin_api_key="root", lora_dir=lora_folder,
                            allowed_hosts=default_allowed_hosts("127.0.0.1", ()))  # fmt: skip
    slotted = Engine.from_card("tiny-wan", device="cpu", lora_slots=LoraSlots(2, 8, 2))
    with HttpServer(slotted, settings, tmp_path / "store", port=0).running() as url:
        user, root = {"Authorization": "Bearer user"}, {"Authorization": "Bearer root"}
        body = {"name": "kv", "path": "kv/lora.safetensors"}
        for path, payload in (("/v1/loras", body), ("/v1/admin/sleep", {"level": 1}), ("/v1/admin/wake", None)):
            refused = httpx.post(url + path, json=payload, headers=user)
            assert refused.status_code == 401 and "--admin-api-key" in refused.json()["error"]["message"], path
        assert httpx.delete(url + "/v1/loras/kv", headers=user).status_code == 401
        assert httpx.post(url + "/v1/loras", json=body, headers=root).status_code == 200
        assert httpx.get(url + "/v1/loras", headers=user).status_code == 200  # reading stays the API key's
        assert httpx.get(url + "/v1/loras", headers=root).status_code == 401
        assert httpx.delete(url + "/v1/loras/kv", headers=root).status_code == 200
    settings = HttpSettings(api_key="user", lora_dir=lora_folder)
    with HttpServer(slotted, settings, tmp_path / "store2", port=0).running() as url:
        assert httpx.post(url + "/v1/loras", json=body, headers={"Authorization": "Bearer user"}).status_code == 200
