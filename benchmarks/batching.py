"""Continuous batching in one process, without HTTP (issue 57's goals, on the default Qwen pair, q4).

``sweep``: C requests at once (Spec-Bench first turns; ``--short``: only those under 100 tokens, a decode-bound load),
for each concurrency level and each ``method:speculation`` configuration, in interleaved rounds after one untimed
warm-up request per configuration (as ``mirrorsd serve`` warms up before it listens); aggregate tok/s,
and each configuration's median as a ratio to batched ``ar`` at the same level. Every batched answer is checked
against the level's first configuration's.

``serial``: the same C requests one at a time against all of them batched (``ar``), interleaved: the batching gain.

``one``: each configuration alone and as a batcher's only member, interleaved per prompt: what the batcher costs.

``long-prompt``: 8 decoding streams, then a 4,000-token prompt arrives: the streams' p99 time per output token
while it is prefilled against their p99 without it, and the prompt's time to first token against an idle batcher,
for each ``--prefill-rows`` (``auto``: paced by the batch's cost)::

    python benchmarks/batching.py sweep --levels 1,2,4,8,16,32 --short --json sweep.json
    python benchmarks/batching.py serial --levels 16 --short
    python benchmarks/batching.py long-prompt --prefill-rows 8,32,auto
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import threading
import time
from pathlib import Path

import mirrorsd
from mirrorsd.api import encode_chat, warm_up
from mirrorsd.batching import Batcher
from mirrorsd.decoding.suffix_index import isolated_shared_indexes
from mirrorsd.execution import release_thread_team
from mirrorsd.plans import cpu_name
from mirrorsd.specbench import load_suite


def prompts(target, short: bool) -> list[list[int]]:
    ids = [encode_chat(target, [{"role": "user", "content": q.turns[0]}]) for q in load_suite("specbench:2")]
    return [i for i in ids if len(i) < 100] if short else ids


def generate(target, draft, ids: list[int], method: str, max_new: int, **options) -> list[int]:
    with isolated_shared_indexes():  # no request may find another's answer (the sweep's rounds repeat prompts)
        return mirrorsd.generate(target, ids, raw=True, method=method,
                                 draft=draft if method in ("sd", "mirror") else None, max_new_tokens=max_new,
                                 temperature=0, **options).token_ids


def parse_config(config: str) -> tuple[str, str, dict[str, str]]:
    """``method:speculation[:option=value...]`` (``ss:fixed:tree_k=1``) -> (method, speculation, options)."""
    method, speculation, *rest = config.split(":")
    return method, speculation, dict(item.split("=", 1) for item in rest)


def batched(batch: list[list[int]], run, prefill_rows: int = 32, speculation: str = "goodput",
            batcher: Batcher | None = None) -> tuple[list, float]:
    """Every request on a thread of its own, all members of one batcher (``batcher``, or a new one); (answers,
    seconds)."""
    b = batcher or Batcher(prefill_rows, speculation=speculation)
    release_thread_team()  # this thread's forwards (the alone runs between) would slow the engine's
    out: list = [None] * len(batch)

    def work(i: int) -> None:
        with b.member():
            out[i] = run(batch[i])

    start = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batch))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - start


def sweep(args, target, draft) -> None:
    ids = prompts(target, args.short)
    configs = {c: parse_config(c) for c in args.configs.split(",")}
    # One batcher per configuration for the whole sweep, as a server keeps one: its cost curve and the goodput
    # rule's acceptance of earlier requests carry over from level to level.
    batchers = {c: Batcher(speculation=speculation) for c, (_, speculation, _) in configs.items()}
    for config, (method, _, options) in configs.items():  # as `mirrorsd serve` does before it listens
        seconds = warm_up(target, method=method, draft=draft, **options)
        print(f"warm-up {config} {seconds:.1f} s", flush=True)
    results: dict = {}
    for r in range(args.rounds):
        for level in args.levels:
            batch = (ids * (level // len(ids) + 1))[:level]
            for config, (method, _, options) in configs.items():
                out, seconds = batched(batch, lambda p, m=method, o=options: generate(target, draft, p, m,
                                                                                       args.max_new_tokens, **o),
                                       batcher=batchers[config])
                rate = sum(map(len, out)) / seconds
                reference = results.setdefault(("answers", level), out)
                results.setdefault((level, config), []).append(rate)
                print(f"round {r} C={level} {config} {seconds:.1f} s {rate:.2f} tok/s equal {out == reference}",
                      flush=True)
    first = next(iter(configs))
    for level in args.levels:
        base = statistics.median(results[(level, first)])
        cells = [f"{c} {statistics.median(results[(level, c)]):.1f} tok/s "
                 f"({statistics.median(results[(level, c)]) / base:.2f}x)" for c in configs]
        print(f"C={level}: " + ", ".join(cells))
    if args.json:
        rows = [{"level": level, "method": m, "speculation": sp, "options": o, "tok_s": results[(level, c)]}
                for level in args.levels for c, (m, sp, o) in configs.items()]
        Path(args.json).write_text(json.dumps({"machine": cpu_name(), "rows": rows}, indent=1) + "\n")


def serial(args, target, draft) -> None:
    ids = prompts(target, args.short)
    for level in args.levels:
        batch = (ids * (level // len(ids) + 1))[:level]
        rates: dict[str, list[float]] = {"one at a time": [], "batched": []}
        for r in range(args.rounds):
            start = time.perf_counter()
            alone = [generate(target, draft, p, "ar", args.max_new_tokens) for p in batch]
            rates["one at a time"].append(sum(map(len, alone)) / (time.perf_counter() - start))
            together, seconds = batched(batch, lambda p: generate(target, draft, p, "ar", args.max_new_tokens))
            rates["batched"].append(sum(map(len, together)) / seconds)
            print(f"round {r} C={level}: one at a time {rates['one at a time'][-1]:.2f} tok/s, batched "
                  f"{rates['batched'][-1]:.2f} tok/s, equal {together == alone}", flush=True)
        one, many = (statistics.median(v) for v in rates.values())
        print(f"C={level}: batched {many:.2f} tok/s = {many / one:.2f}x one at a time ({one:.2f} tok/s)")


def one(args, target, draft) -> None:
    """Each method alone and as a batcher's only member, interleaved per prompt: what the batcher itself costs. As
    in a server, each configuration keeps one batcher for all its requests, so the goodput rule decides from the
    cost line and the acceptance of the requests before (a new batcher would leave every window uncapped)."""
    rates: dict = {}
    configs = {c: parse_config(c) for c in args.configs.split(",")}
    batchers = {c: Batcher(32, speculation=speculation) for c, (_, speculation, _) in configs.items()}
    alone = {f"{m}{''.join(f':{k}={v}' for k, v in o.items())}": (m, o) for m, _, o in configs.values()}
    cells = [(name, None) for name in alone] + [(c, batchers[c]) for c in configs]
    for r in range(args.rounds):
        for i, ids in enumerate(prompts(target, args.short)):
            k = (i + r) % len(cells)
            for name, batcher in cells[k:] + cells[:k]:
                method, options = alone[name] if batcher is None else (configs[name][0], configs[name][2])
                run = functools.partial(generate, target, draft, method=method, max_new=args.max_new_tokens, **options)
                if batcher is None:
                    start = time.perf_counter()
                    out = run(ids)
                    seconds = time.perf_counter() - start
                else:
                    (out,), seconds = batched([ids], run, batcher=batcher)
                rates.setdefault((name, batcher is None), []).append(len(out) / seconds)
    for name in alone:
        print(f"{name} alone: {statistics.median(rates[(name, True)]):.2f} tok/s")
    for config, (method, _, options) in configs.items():
        solo = rates[next(n for n, mo in alone.items() if mo == (method, options)), True]
        inside = rates[config, False]
        pairs = statistics.median(b / a for a, b in zip(solo, inside, strict=True))
        print(f"{config}: a batcher's only member {statistics.median(inside):.2f} tok/s "
              f"({statistics.median(inside) / statistics.median(solo):.2f}x alone; per prompt median {pairs:.2f}x)")


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def long_prompt(args, target, draft) -> None:
    """The 8 streams decode past EOS until the prompt's first token, so they run beside its whole prefill (streams
    that ended first would hand the prompt an idle machine and flatter its time to first token)."""
    short = prompts(target, True)[:8]
    long_ids = [t for i in prompts(target, False) for t in i]
    long_ids = (long_ids * (4000 // len(long_ids) + 1))[:4000]

    def decode(ids: list[int], out: dict, key: int, until: threading.Event, tokens: int) -> None:
        stream = mirrorsd.stream(target, ids, raw=True, method="ar", max_new_tokens=tokens, temperature=0,
                                 ignore_eos=True)
        last = None
        for delta in stream.deltas():
            now = time.perf_counter()
            if last is not None and delta.token_ids:
                out.setdefault(key, []).append(((now - last) / len(delta.token_ids), now))
            last = now
            out.setdefault("decoding", {}).setdefault(key, now)  # its first token
            if until.is_set():
                break
        stream.close()

    def first_token(out: dict, done: threading.Event) -> None:
        start = time.perf_counter()
        stream = mirrorsd.stream(target, long_ids, raw=True, method="ar", max_new_tokens=2, temperature=0)
        next(iter(stream.deltas()))
        out["ttft"], out["window"] = time.perf_counter() - start, (start, time.perf_counter())
        done.set()
        stream.close()

    def streams(rows: int | None, prompt: bool) -> dict:
        """The 8 streams (48 tokens each; with ``prompt``, until the prompt's first token), and the prompt."""
        seen: dict = {}
        done = threading.Event()
        jobs = [lambda _, i=i: decode(short[i], seen, i, done, 4000 if prompt else 48) for i in range(len(short))]
        if prompt:
            jobs.append(lambda _: (time.sleep(3.0), first_token(seen, done)))
        batched(jobs, lambda job: job(None), rows)
        return seen

    idle: dict = {}
    batched([long_ids], lambda _: first_token(idle, threading.Event()))  # no window runs: 512-row chunks
    print(f"idle: the 4000-token prompt's time to first token {idle['ttft']:.1f} s", flush=True)
    results = []
    for rows in args.prefill_rows:
        seen = streams(rows, False)
        steady = max(seen["decoding"].values())  # every stream decodes: the short prompts' own prefill is over
        base = p99([d for i in range(len(short)) for d, at in seen.get(i, []) if at > steady])
        seen = streams(rows, True)
        a, z = seen["window"]
        during = p99([d for i in range(len(short)) for d, at in seen.get(i, []) if a <= at <= z])
        name = "auto" if rows is None else rows
        print(f"prefill_rows={name}: 8 streams' p99 time per output token {base * 1e3:.0f} ms alone, "
              f"{during * 1e3:.0f} ms while a 4000-token prompt arrives ({during / base:.2f}x); its time to first "
              f"token {seen['ttft']:.1f} s ({seen['ttft'] / idle['ttft']:.2f}x idle)", flush=True)
        results.append({"prefill_rows": name, "p99_alone_s": base, "p99_during_s": during, "ttft_s": seen["ttft"],
                        "ttft_idle_s": idle["ttft"]})
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": cpu_name(), "rows": results}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["sweep", "serial", "one", "long-prompt"])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="for sd (loaded only when a config names it)")
    ap.add_argument("--levels", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--configs", default="ar:fixed,suffix:fixed,suffix:goodput,sd:fixed,sd:goodput",
                    help="method:speculation[:option=value...] each, the first the reference (ss:fixed:tree_k=1: "
                         "Speculative Streaming's best path, no tree)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--short", action="store_true", help="only the prompts under 100 tokens (a decode-bound load)")
    ap.add_argument("--json", help="sweep: write every round's tok/s here; long-prompt: each setting's figures")
    ap.add_argument("--prefill-rows", default="8,32,auto",
                    type=lambda s: [None if x == "auto" else int(x) for x in s.split(",")])
    args = ap.parse_args()
    target = mirrorsd.load_model(args.target, progress=False)
    needs_draft = args.what in ("sweep", "one") and any(parse_config(c)[0] in ("sd", "mirror")
                                                        for c in args.configs.split(","))
    draft = mirrorsd.load_model(args.draft, progress=False) if needs_draft else None
    {"sweep": sweep, "serial": serial, "one": one, "long-prompt": long_prompt}[args.what](args, target, draft)


if __name__ == "__main__":
    main()
