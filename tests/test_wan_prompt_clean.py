"""Wan's prompt cleaning, written out in fvgraph/loops/wan_parts.py, equals diffusers' own."""

import pytest
from diffusers.pipelines.wan.pipeline_wan import prompt_clean as diffusers_prompt_clean

from fvgraph.loops.wan_parts import prompt_clean

PROMPTS = [
    "a red fox",
    "  a red   fox\tin\n\nthe snow  ",
    "fish &amp;amp; chips &lt;b&gt; &#39;quoted&#39;",
    "no\u00a0break\u2003em\u3000ideographic spaces",
    "separators \x1c\x1d\x1e\x1f and \x85 next line",
    "",
    "   ",
    "emoji 🦊 and accents café",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_clean_equals_diffusers(prompt):
    assert prompt_clean(prompt) == diffusers_prompt_clean(prompt)
