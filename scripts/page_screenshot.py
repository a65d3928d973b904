"""Drive the chat page of a running `mirrorsd serve` in a real browser and save a screenshot.

Headless Chromium (Debian's ``chromium`` package) through Playwright (``pip install playwright``; no browser
download: it drives ``/usr/bin/chromium``). Types the prompt, presses Enter, waits for the streamed reply and
checks that it was coloured by token source. Used by ``tests/server/test_server_page.py`` (slow) and for
``docs/server_page.png``::

    mirrorsd serve --method suffix &
    python scripts/page_screenshot.py --url http://127.0.0.1:8000 --out docs/server_page.png
"""

from __future__ import annotations

import argparse
import json
import sys


def screenshot(url: str, prompt: str, out: str, *, method: str = "", max_tokens: int = 128, api_key: str = "",
               browser: str = "/usr/bin/chromium", timeout_s: float = 300) -> dict[str, int]:
    """Send ``prompt`` from the page at ``url``, save a screenshot to ``out``; token spans per source."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=browser, args=["--no-sandbox"])
        try:
            page = b.new_page(viewport={"width": 1000, "height": 760})
            page.goto(url)
            if api_key:
                page.fill("#key", api_key)
            if method:
                page.select_option("#method", method)
            page.fill("#max_tokens", str(max_tokens))
            page.fill("#prompt", prompt)
            page.press("#prompt", "Enter")
            page.wait_for_selector("body[data-done='1'], .msg.error", timeout=timeout_s * 1000)
            errors = page.locator(".msg.error").all_inner_texts()
            if errors:
                raise RuntimeError(f"the page shows an error: {errors[0]}")
            page.screenshot(path=out)
            return {"draft": page.locator(".msg .tok.draft").count(),
                    "target": page.locator(".msg .tok.target").count(),
                    "tokens": int(page.inner_text("#tokens")), "steps": int(page.inner_text("#steps"))}
        finally:
            b.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--prompt", default="Rename the variable `x` to `total` in this code and change nothing "
                    "else:\n\ndef add_all(items):\n    x = 0\n    for item in items:\n        x += item\n"
                    "    return x\n")
    ap.add_argument("--method", default="", help="the page's method menu (default: the server's)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--api-key", default="")
    ap.add_argument("--browser", default="/usr/bin/chromium")
    ap.add_argument("--out", default="server_page.png")
    args = ap.parse_args()
    counts = screenshot(args.url, args.prompt, args.out, method=args.method, max_tokens=args.max_tokens,
                        api_key=args.api_key, browser=args.browser)
    print(json.dumps({"screenshot": args.out, **counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
