"""Two-turn chats against two running servers of one model, one with the prefix cache off, one with it on.

Each multi-turn question of a Spec-Bench subset is asked as a chat of two turns (the second carries the first turn's
answer), the servers alternating which goes first per question; printed: each turn's time to first token, the
prompt tokens the server restored (``usage.prompt_tokens_details.cached_tokens``) and whether both servers gave the
same answers. Start the servers first, e.g.::

    mirrorsd serve --method ar --port 8101 --prefix-cache-mib 0 --enable-prompt-tokens-details &
    mirrorsd serve --method ar --port 8102 --enable-prompt-tokens-details &
    python benchmarks/prefix_cache_turns.py http://127.0.0.1:8101 http://127.0.0.1:8102 --suite specbench:8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import openai

from mirrorsd.specbench import load_suite


def ask(url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=3600)
    start, first, text, usage = time.perf_counter(), None, "", None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    details = usage.prompt_tokens_details
    return {"text": text, "ttft": (first or time.perf_counter()) - start, "e2e": time.perf_counter() - start,
            "prompt": usage.prompt_tokens, "cached": details.cached_tokens if details else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("off", help="URL of the server without a prefix cache")
    ap.add_argument("on", help="URL of the server with one")
    ap.add_argument("--suite", default="specbench:8", help="questions; those with two turns are asked")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", help="write every turn's figures here")
    args = ap.parse_args()
    model = openai.OpenAI(base_url=args.off + "/v1", api_key="none").models.list().data[0].id
    rows = []
    for i, q in enumerate(q for q in load_suite(args.suite) if len(q.turns) > 1):
        servers = [("off", args.off), ("on", args.on)]
        for name, url in servers if i % 2 == 0 else servers[::-1]:
            chat = [{"role": "user", "content": q.turns[0]}]
            first = ask(url, model, chat, args.max_tokens)
            chat += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": q.turns[1]}]
            second = ask(url, model, chat, args.max_tokens)
            rows.append({"question": q.question_id, "server": name, "turn1": first, "turn2": second})
            print(f"q{q.question_id} {name}: turn 1 {first['prompt']} tokens, ttft {first['ttft']:.2f} s; turn 2 "
                  f"{second['prompt']} tokens ({second['cached']} restored), ttft {second['ttft']:.2f} s", flush=True)

    def median(server: str, turn: str, key: str) -> float:
        return statistics.median(r[turn][key] for r in rows if r["server"] == server)

    pairs = [(a, b) for a in rows if a["server"] == "off" for b in rows
             if b["server"] == "on" and b["question"] == a["question"]]
    ratios = [a["turn2"]["ttft"] / b["turn2"]["ttft"] for a, b in pairs]
    same = all(a[t]["text"] == b[t]["text"] for a, b in pairs for t in ("turn1", "turn2"))
    for turn in ("turn1", "turn2"):
        print(f"{turn}: time to first token (median) off {median('off', turn, 'ttft'):.2f} s, on "
              f"{median('on', turn, 'ttft'):.2f} s; whole answer {median('off', turn, 'e2e'):.2f} / "
              f"{median('on', turn, 'e2e'):.2f} s")
    print(f"turn 2 off / on per question: median {statistics.median(ratios):.2f} ({min(ratios):.2f}-"
          f"{max(ratios):.2f}); answers identical: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
