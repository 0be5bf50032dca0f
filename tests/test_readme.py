"""The README tells a newcomer the truth: its cards table lists every card with the Hub repo it loads,
and its `make demo` transcript is what the demo's command prints (timings aside)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from typer.testing import CliRunner

from fvgraph.cards import all_cards, card_names
from fvgraph.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _card_rows() -> dict[str, str]:
    rows = {}
    table = README[README.index("## Cards"):README.index("## Layout")]
    for line in table.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            for card in re.findall(r"`([^`]+)`", first):
                rows[card] = line
    return rows


def test_the_cards_table_lists_every_card_and_its_hub_repo():
    rows = _card_rows()
    assert sorted(rows) == card_names()
    for card in all_cards():
        for repo in card.hub_repos:
            assert f"`{repo}`" in rows[card.card_id], card.card_id


def test_the_families_table_names_every_family():
    families = README[README.index("## Families"):README.index("## Cards")]
    for name in ("Wan 2.1 / 2.2", "HunyuanVideo-1.5", "FLUX.1", "Qwen-Image"):
        assert f"| {name} |" in families


def test_the_demo_transcript_is_what_the_demo_prints(tmp_path, monkeypatch):
    transcript = README[README.index("What `make demo` prints"):].split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    makefile = (ROOT / "Makefile").read_text()
    setup, command = transcript[:2]  # make echoes the set-up's install, then the demo's command
    for line in (setup, command):
        assert line.replace("python3 ", "$(PYTHON) ") in makefile, line
    args = shlex.split(command)[3:]  # after `python3 -m fvgraph`
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    printed = [line.rstrip() for line in result.output.splitlines()]
    timed = re.compile(r"\d+\.\d+ s\)|│|┃|┏|┡|└")  # the table and its load time vary run to run
    for line in transcript[2:]:
        if not timed.search(line):
            assert line in printed, line
    assert (tmp_path / "outputs" / "tiny-wan.gif").is_file()
