"""Would ``suffix`` gain from drafting a small tree instead of a chain? Replayed offline over ``ar``'s answers.

The suffix proposer's lookups (request text + the shipped datastore, the same acceptance priors) are replayed
over the answers of a ``mirrorsd bench`` run's ``answers/ar.jsonl``, with a step cost of ``1 + c·nodes`` in
one-token forwards. Nodes are added best-first by estimated acceptance (match frequency share × the acceptance
model), with up to ``width`` alternatives at the first level and chains below, while they pay for themselves
under the same rule as the chain (docs/drafting.md). Prints tokens per unit of cost and tokens per step.

    python benchmarks/suffix_tree_replay.py BENCH_OUT/answers/ar.jsonl --suite specbench:2 --cost 0.07
"""

from __future__ import annotations

import argparse
import heapq
import json
from pathlib import Path

import mirrorsd
from mirrorsd.api import encode_chat
from mirrorsd.decoding.lookup import AcceptanceModel
from mirrorsd.decoding.suffix_index import Match, SuffixIndex, datastore
from mirrorsd.specbench import load_suite

WINDOW, FACTOR, MIN_PROB = 16, 2.0, 0.1  # suffix:factor=2.0, what `auto` runs


def propose(found: Match | None, width: int, acceptance: AcceptanceModel, ratio: float) -> list[tuple[int, int]]:
    """(parent node index, token) pairs, parents first; -1 is the last committed token."""
    if found is None:
        return []
    limit = min(WINDOW, int(-(-FACTOR * found.length // 1)))
    nodes: list[tuple[int, int]] = []
    heap: list[tuple[float, int, int, int, object, int]] = []
    order = 0

    def push(trie: object, parent: int, p_parent: float, depth: int) -> None:
        nonlocal order
        kids = sorted(trie.children.items(), key=lambda kv: -kv[1].count)  # type: ignore[attr-defined]
        for token, child in kids[: width if depth == 0 else 1]:
            p = p_parent * child.count / trie.count  # type: ignore[attr-defined]
            p *= acceptance.first_token(found.length) if depth == 0 else acceptance.next_token()
            order += 1
            heapq.heappush(heap, (-p, order, parent, token, child, depth))

    push(found.root, -1, 1.0, 0)
    expected = 0.0
    while heap and len(nodes) < limit:
        neg_p, _, parent, token, child, depth = heapq.heappop(heap)
        if -neg_p < max(MIN_PROB, ratio * (1 + expected) / (1 + ratio * len(nodes))):
            break
        nodes.append((parent, token))
        expected += -neg_p
        push(child, len(nodes) - 1, -neg_p, depth + 1)
    return nodes


def replay(answers: list[dict], questions: dict, target: mirrorsd.LoadedModel, width: int, cost: float
           ) -> tuple[float, float]:
    fixed = datastore("auto", f"vocab{target.config.vocab_size}", target.config.vocab_size)
    tokens = spent = steps = 0.0
    for answer in answers:
        messages: list[dict[str, str]] = []
        for turn, text in zip(questions[answer["question_id"]].turns, answer["choices"][0]["turns"], strict=False):
            messages.append({"role": "user", "content": turn})
            index = SuffixIndex()
            doc = index.add(encode_chat(target, messages))
            truth = target.tokenizer.encode(text, add_special_tokens=False)
            messages.append({"role": "assistant", "content": text})
            own, stored_model = AcceptanceModel(), AcceptanceModel()
            pos = 0
            while pos < len(truth):
                text_ids = index.docs[doc]
                found, model = index.continuations(text_ids, WINDOW), own
                stored = fixed.continuations(text_ids, WINDOW) if fixed is not None else None
                if stored is not None and (found is None or stored.length > found.length):
                    found, model = stored, stored_model
                nodes = propose(found, width, model, cost)
                accepted, at = 0, -1
                while pos + accepted < len(truth):
                    nxt = [i for i, (p, tk) in enumerate(nodes) if p == at and tk == truth[pos + accepted]]
                    if not nxt:
                        break
                    at, accepted = nxt[0], accepted + 1
                if nodes and found is not None:
                    model.observe(found.length, len(nodes), accepted)
                step = min(accepted + 1, len(truth) - pos)
                index.extend(doc, truth[pos : pos + step])
                pos += step
                tokens, spent, steps = tokens + step, spent + 1 + cost * len(nodes), steps + 1
    return tokens / spent, tokens / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("answers", help="answers/ar.jsonl of a `mirrorsd bench` run")
    p.add_argument("--suite", default="specbench:2", help="the suite that run used")
    p.add_argument("--cost", type=float, default=0.07, help="extra cost of a window token, in one-token forwards")
    p.add_argument("--widths", default="1,2,3", help="alternatives at the first level (1 = the chain)")
    args = p.parse_args()
    target = mirrorsd.load_model("qwen2.5-coder-1.5b", progress=False)
    questions = {q.question_id: q for q in load_suite(args.suite)}
    answers = [json.loads(line) for line in Path(args.answers).read_text(encoding="utf-8").splitlines() if line]
    for width in map(int, args.widths.split(",")):
        per_cost, per_step = replay(answers, questions, target, width, args.cost)
        print(f"width {width}: {per_cost:.3f} tokens per unit of cost, {per_step:.3f} tokens per step")


if __name__ == "__main__":
    main()
