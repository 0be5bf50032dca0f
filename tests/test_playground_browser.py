"""The playground page in a real headless Chromium: key, prompt, submit, per-step progress, the video plays.

Debian's chromium and chromium-driver (apt; `make test` installs them through `make browser`), driven by
selenium with both paths given, so Selenium Manager never looks anything up or downloads a browser.
The screenshot lands under the test's tmp dir, and in $FVGRAPH_TEST_ARTIFACTS when that is set.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from http_helpers import KEY, live_server

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
INSTALL = "run `make browser` (as root on Debian: apt-get install -y chromium chromium-driver)"
# Small and quick on a CPU, at -O0: 4 denoise steps of a 64x64 clip of 9 frames (1.125 s at 8 fps).
FORM = {"width": "64", "height": "64", "frames": "9", "fps": "8", "steps": "4", "guidance": "5", "seed": "7", "preview-every": "2"}


@pytest.fixture(scope="module")
def browser():
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        pytest.fail(f"the playground's browser test needs {' and '.join(missing)}: {INSTALL}", pytrace=False)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("the playground's browser test needs selenium: pip install -e '.[test]'", pytrace=False)
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager, should anything call it, stays off the network
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1100",
                     "--autoplay-policy=no-user-gesture-required", "--disable-extensions", "--no-first-run"):  # fmt: skip
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, condition, timeout_s: float, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(lambda d: condition(d))
    except Exception as err:
        shown = driver.find_element("id", "error").text or "(no error shown)"
        raise AssertionError(f"timed out waiting for {what}; the page says: {shown}") from err


def _save_screenshot(driver, tmp_path: Path) -> Path:
    shot = tmp_path / "playground.png"
    assert driver.save_screenshot(str(shot)), "the screenshot was not written"
    if folder := os.environ.get("FVGRAPH_TEST_ARTIFACTS"):
        Path(folder).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(folder) / shot.name)
    return shot


def _connect_and_submit(browser, by_id) -> None:
    """What a person does: the page asks for the key, shows the card once given it, takes the form."""
    _wait(browser, lambda d: "API key" in by_id("error").text, 15, "the page to ask for the key")
    asked = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert all("/v1/playground/config" in message and "401" in message for message in asked), asked  # only that
    assert by_id("submit").get_attribute("disabled") is not None  # nothing to submit to before connecting

    by_id("key").send_keys(KEY)
    by_id("connect").click()
    _wait(browser, lambda d: "tiny-wan" in by_id("card").text and by_id("submit").is_enabled(), 15, "the card")
    assert "magcache" in by_id("card").text and by_id("server-status").text == "connected to tiny-wan, ready"
    options = [option.get_attribute("value") for option in by_id("cache").find_elements("tag name", "option")]
    assert options == ["none", "magcache", "teacache", "taylorseer", "fbcache"]
    for name, value in {"prompt": "a red fox running through fresh snow", **FORM}.items():
        by_id(name).clear()
        by_id(name).send_keys(value)
    by_id("submit").click()


def test_the_page_generates_streams_progress_and_plays_the_video(browser, tiny_engine, tmp_path):
    with live_server(tiny_engine, tmp_path) as (_, url):
        browser.get(url + "/")
        by_id = lambda name: browser.find_element("id", name)  # noqa: E731
        _connect_and_submit(browser, by_id)

        _wait(browser, lambda d: by_id("video-id").text.startswith("video_"), 15, "the video to be accepted")
        _wait(browser, lambda d: by_id("timings").text.count(" s") > 1, 120, "the video to finish and load")
        assert by_id("error").is_displayed() is False, by_id("error").text
        assert browser.execute_script("return document.getElementById('progress').value") == 100
        assert by_id("progress-text").text == "100%"
        denoise = [line for line in by_id("step-log").text.splitlines() if "/4" in line]
        assert [line.split()[1].rstrip(",") for line in denoise] == ["1/4", "2/4", "3/4", "4/4"]  # each step streamed
        preview = browser.execute_script(  # updated in place from each preview event; the last is step 4's
            "const p = document.getElementById('preview');"
            "return {shown: !p.hidden, step: p.dataset.step, width: p.naturalWidth, src: p.src.slice(0, 22)};")
        assert preview == {"shown": True, "step": "4", "width": 8, "src": "data:image/png;base64,"}  # 64 px / 8
        timings = by_id("timings").text
        assert "total" in timings and "submit to playable" in timings  # the server's, from the done event, and ours

        video = _wait(browser, lambda d: d.execute_script(
            "const v = document.getElementById('video');"
            "return v.readyState >= 2 && v.currentTime > 0 && !v.error ? "
            "{src: v.currentSrc, width: v.videoWidth, length: v.duration} : null;"
        ), 20, "the video to play")  # fmt: skip
        assert video["src"].startswith("blob:" + url) and video["width"] == 64
        assert video["length"] == pytest.approx(1.125, abs=0.05)  # 9 frames at 8 fps

        # Everything the page loaded came from this server (the video is a blob of a response): no other origin.
        loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert loaded and all(name.startswith(url + "/") for name in loaded), loaded
        problems = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
        assert not problems, problems  # a blocked script (CSP), an uncaught error, a failed request
        shot = _save_screenshot(browser, tmp_path)
        assert shot.stat().st_size > 10_000


def test_the_page_plays_the_video_from_its_first_streamed_fragment(browser, tiny_engine, tmp_path, monkeypatch):
    """Each decode step slowed by 0.6 s: the page's <video> has frames to show (and plays) while the
    request is still running, from GET /v1/videos/{id}/content?stream=true, and ends with every frame."""
    run_batch = tiny_engine.executor.run_batch

    def slow_decode(plans, slots, lane=0):
        if plans[0].kind == "vae_decode_chunk":
            time.sleep(0.6)
        return run_batch(plans, slots, lane)

    monkeypatch.setattr(tiny_engine.executor, "run_batch", slow_decode)
    monkeypatch.setitem(FORM, "frames", "17")  # 5 decode steps: 1 frame, then 4 each
    with live_server(tiny_engine, tmp_path) as (srv, url):
        browser.get(url + "/")
        by_id = lambda name: browser.find_element("id", name)  # noqa: E731
        _connect_and_submit(browser, by_id)
        video_id = _wait(browser, lambda d: by_id("video-id").text.startswith("video_") and by_id("video-id").text, 15,
                         "the video to be accepted")  # fmt: skip
        playing = _wait(browser, lambda d: d.execute_script(
            "const v = document.getElementById('video');"
            "return v.readyState >= 2 && !v.error ? {src: v.currentSrc, width: v.videoWidth} : null;"
        ) and {"running": srv.served.knows(video_id)}, 120, "the streamed video to show a frame")  # fmt: skip
        assert playing["running"], "the video only played once the request had ended"
        _wait(browser, lambda d: by_id("timings").text.count(" s") > 1, 120, "the video to finish")
        ended = _wait(browser, lambda d: d.execute_script(
            "const v = document.getElementById('video');"
            "return v.currentTime > 0 && !v.error ? {src: v.currentSrc, length: v.duration} : null;"
        ), 20, "the video to play on")  # fmt: skip
        assert ended["src"].startswith("blob:" + url)  # the MediaSource the stream fills
        assert ended["length"] == pytest.approx(17 / 8, abs=0.05)  # every frame arrived: 17 at 8 fps
        loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert f"{url}/v1/videos/{video_id}/content?stream=true" in loaded
        assert f"{url}/v1/videos/{video_id}/content" not in loaded  # the stream was played; no second download
        problems = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
        assert not problems, problems
