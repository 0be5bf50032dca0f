"""The playground page without a browser: how `/` serves it, `--no-playground`, and what the page may reach."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
from http_helpers import KEY, httpx, live_server, wait_for

from fvgraph.serving.http_playground import content_security_policy

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "fvgraph" / "serving" / "playground" / "index.html"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def url(tiny_engine, tmp_path_factory):
    with live_server(tiny_engine, tmp_path_factory.mktemp("playground")) as (_, base_url):
        yield base_url


def test_the_page_is_served_at_the_root_without_a_key_under_a_policy_of_its_own(url):
    page = httpx.get(url + "/")  # the server has a key: the page is open, what it asks for is not
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.text == PAGE.read_text(encoding="utf-8") and "<title>fvgraph playground</title>" in page.text
    policy = page.headers["content-security-policy"]
    assert policy == content_security_policy(page.text)
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "media-src blob:" in policy
    assert policy.count("'sha256-") == 2 and "unsafe" not in policy  # its one script and one style, by hash
    assert page.headers["x-content-type-options"] == "nosniff"
    assert httpx.post(url + "/").json()["error"]["code"] == "method_not_allowed"


def test_the_config_is_behind_the_key_and_describes_the_served_card(url, tiny_card):
    assert httpx.get(url + "/v1/playground/config").status_code == 401
    config = httpx.get(url + "/v1/playground/config", headers=AUTH).json()
    assert config["model"] == "tiny-wan" and config["loop"] == "t2v" and config["takes_image"] is False
    assert config["defaults"] == {"width": 64, "height": 64, "num_frames": 9, "num_inference_steps": 8,
                                  "guidance_scale": 5.0, "fps": 16.0, "cache": "none"}  # fmt: skip
    limits = config["limits"]
    assert (limits["max_width"], limits["max_frames"], limits["num_inference_steps"]) == (256, 33, [1, 50])
    assert (limits["spatial_multiple"], limits["temporal_multiple"]) == (16, 4)
    assert config["cache_methods"] == ["magcache", "teacache", "taylorseer", "fbcache"]


def test_the_page_reaches_only_its_own_origin():
    html = PAGE.read_text(encoding="utf-8")
    assert not re.search(r"[a-z][a-z0-9+.-]*://|//[a-z0-9]", html, re.I), "a URL with a scheme or a host"
    for url in re.findall(r"""\b(?:src|href|action|poster)\s*=\s*["']([^"']*)["']""", html):
        assert url in ("data:,", "") or (url.startswith("/") and not url.startswith("//")), url
    assert re.findall(r"\bfetch\(\s*([^,)]+)", html) == ["path", '"/ready"']  # api(path) and /ready, nothing else
    for path in re.findall(r"""\bapi\(\s*([`"'][^`"']*)""", html):
        assert re.match(r"""[`"']/v1/""", path), path
    for reach in ("EventSource", "XMLHttpRequest", "WebSocket", "import(", "sendBeacon", "<iframe", "<link rel=\"stylesheet\""):
        assert reach not in html, reach
    assert len(re.findall(r"<script", html)) == len(re.findall(r"<style", html)) == 1  # what the policy hashes
    ids = re.findall(r'\bid="([^"]+)"', html)
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def test_the_page_is_package_data():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "fvgraph.serving.playground" in setuptools["packages"]  # a wheel holds the page
    assert any(fnmatch(PAGE.name, pattern) for pattern in setuptools["package-data"]["fvgraph.serving.playground"])


def test_no_playground_turns_the_page_and_its_config_off(tmp_path):
    command = [sys.executable, "-m", "fvgraph", "serve", "-O0", "--port", "0", "-o", str(tmp_path), "--no-playground"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "FVGRAPH_API_KEY": KEY})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
    reader.start()
    try:
        url = wait_for(lambda: next((m[1] for line in lines if (m := re.search(r"on (http://\S+)/v1", line))), None),
                       timeout_s=120, what="the server to listen")  # fmt: skip
        root = httpx.get(url + "/")
        assert root.status_code == 404 and root.headers["content-type"] == "application/json"
        assert root.json() == {"error": {"message": "GET /: Not Found", "type": "invalid_request_error",
                                         "param": None, "code": "not_found"}}  # fmt: skip
        assert httpx.get(url + "/v1/playground/config", headers=AUTH).status_code == 404
        assert httpx.get(url + "/health").status_code == 200  # the API itself serves on
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(timeout=5)
