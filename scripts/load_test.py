"""A bounded load test of a running `mirrorsd serve` with the official `openai` client.

N concurrent clients each send a few streamed chat requests (first turns of a suite's questions); reports
requests, concurrency, throughput, latency percentiles and time to first token, checks every answer against
the same request decoded alone with ``--check-method`` (greedy, so lossless means equal), and checks that the
server's Prometheus counters moved by exactly what the responses' ``usage`` says::

    mirrorsd serve --method suffix &
    python scripts/load_test.py --url http://127.0.0.1:8000 --clients 16 --requests 2 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from mirrorsd.specbench import load_suite


def counters(url: str, key: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"}).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def ask(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, method: str | None) -> dict:
    start = time.perf_counter()
    first = None
    text, usage = [], None
    extra = {"mirrorsd": {"method": method}} if method else None
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body=extra):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    return {"prompt": prompt, "text": "".join(text), "latency": end - start,
            "ttft": (first or end) - start, "usage": usage}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--suite", default="specbench:2", help="where the prompts come from (first turns)")
    ap.add_argument("--method", default=None, help="mirrorsd.method of the load (default: the server's)")
    ap.add_argument("--check-method", default="ar", help="the reference each answer must equal ('' skips)")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()

    client = openai.OpenAI(base_url=args.url + "/v1", api_key=args.api_key, max_retries=0, timeout=3600)
    model = client.models.list().data[0].id
    prompts = [q.turns[0] for q in load_suite(args.suite)]
    before = counters(args.url, args.api_key)

    def session(i: int) -> list[dict]:
        return [ask(client, model, prompts[(i * args.requests + j) % len(prompts)], args.max_tokens, args.method)
                for j in range(args.requests)]

    start = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        results = [r for rs in pool.map(session, range(args.clients)) for r in rs]
    wall = time.perf_counter() - start
    after = counters(args.url, args.api_key)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    tokens = sum(r["usage"].completion_tokens for r in results)
    consistent = {
        "requests": grew("mirrorsd:request_success_total") == len(results),
        "generation_tokens": grew("mirrorsd:generation_tokens_total") == tokens,
        "accepted_tokens": grew("mirrorsd:spec_decode_num_accepted_tokens_total")
        == sum(r["usage"].model_extra["accepted_tokens"] for r in results),
        "draft_tokens": grew("mirrorsd:spec_decode_num_draft_tokens_total")
        == sum(r["usage"].model_extra["drafted_tokens"] for r in results),
    }
    report = {"model": model, "method": args.method or "server default", "requests": len(results),
              "clients": args.clients, "max_tokens": args.max_tokens, "wall_s": round(wall, 2),
              "completion_tokens": tokens, "throughput_tok_s": round(tokens / wall, 2),
              "requests_per_s": round(len(results) / wall, 3),
              "latency_s": {"p50": round(statistics.median(r["latency"] for r in results), 2),
                            "p99": round(percentile([r["latency"] for r in results], 0.99), 2)},
              "ttft_s": {"p50": round(statistics.median(r["ttft"] for r in results), 2),
                         "p99": round(percentile([r["ttft"] for r in results], 0.99), 2)},
              "mean_accepted_length": round(1 + grew("mirrorsd:spec_decode_num_accepted_tokens_total")
                                            / max(1.0, grew("mirrorsd:num_decode_steps_total")), 2),
              "metrics_consistent": consistent}
    equal = 0
    if args.check_method:
        wants = {p: ask(client, model, p, args.max_tokens, args.check_method)["text"]
                 for p in {r["prompt"] for r in results}}
        equal = sum(r["text"] == wants[r["prompt"]] for r in results)
        report["answers_equal_" + args.check_method] = f"{equal}/{len(results)}"
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    equal_all = not args.check_method or equal == len(results)
    return 0 if all(consistent.values()) and equal_all else 1


if __name__ == "__main__":
    sys.exit(main())
