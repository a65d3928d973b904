"""The README's "adding a method" example runs as written and is lossless."""

from __future__ import annotations

import re
from pathlib import Path

import mirrorsd
from mirrorsd.decoding import get_method

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_method_example_registers_and_equals_ar(tiny_pair):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    example = next(b for b in blocks if 'register("lookup"' in b)
    exec(compile(example, "README.md", "exec"), {})  # noqa: S102 - our own documentation
    assert not get_method("lookup").needs_draft
    target, _ = tiny_pair
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    for sampling in ({}, {"temperature": 0.8, "seed": 5}):
        want = mirrorsd.generate(target, prompt, method="ar", max_new_tokens=20, **sampling)
        got = mirrorsd.generate(target, prompt, method="lookup", gamma=3, max_new_tokens=20, **sampling)
        assert got.token_ids == want.token_ids
        assert sum(a + 1 for a in got.stats.accepted) == 20
        assert sum(got.stats.drafted) > 0  # the example's proposer drafted
