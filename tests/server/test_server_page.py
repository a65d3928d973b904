"""The chat page in a real browser (slow): headless Chromium sends a prompt and the reply is coloured."""

from __future__ import annotations

import importlib.util
import shutil
import sys

import pytest

from tests.helpers import REPO, LiveServer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="needs pip install playwright"),
    pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium package"),
]
MODEL = "smollm2-135m"


def test_page_streams_a_coloured_reply(tmp_path):
    import mirrorsd
    from mirrorsd.server import ServerConfig, create_app

    sys.path.insert(0, str(REPO / "scripts"))
    from page_screenshot import screenshot

    target = mirrorsd.load_model(MODEL, progress=False)
    server = LiveServer(create_app(target, None, ServerConfig(MODEL, method="suffix", api_key="k")))
    try:
        out = tmp_path / "page.png"
        counts = screenshot(server.url, "Repeat after me exactly: one two three four five six seven eight.",
                            str(out), max_tokens=48, api_key="k", browser=shutil.which("chromium"))
    finally:
        server.stop()
    assert out.stat().st_size > 10_000
    assert counts["target"] >= 1 and counts["tokens"] >= counts["steps"] >= 1
    assert counts["draft"] + counts["target"] >= counts["tokens"]  # every token's text is in a coloured span
