"""Write the suffix proposer's datastore for a tokenizer: a model's own greedy answers to our chat prompts.

The answers are the ones ``mirrorsd.vocab_tables.answers_of`` generates and caches (the draft-vocabulary and stream
prompt sets, never Spec-Bench's), so a rerun with the same model and length rewrites the same file in seconds.
``mirrorsd/data/suffix/vocab<N>.json.gz`` is then what ``suffix``'s ``datastore=auto`` loads for every model with
that vocabulary (docs/drafting.md).

    python scripts/make_suffix_datastore.py --model qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from mirrorsd.vocab_tables import PROMPT_SETS, answers_of
from mirrorsd.zoo import resolve

OUT = Path(__file__).resolve().parent.parent / "mirrorsd" / "data" / "suffix"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="zoo model whose answers fill the datastore "
                   "(default: the default target)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer (default 128)")
    args = p.parse_args()
    docs = [ids for prompt_set in PROMPT_SETS for ids in answers_of(args.model, args.max_new_tokens, prompt_set)]
    vocab = json.loads((resolve(args.model) / "config.json").read_text())["vocab_size"]
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"vocab{vocab}.json.gz"
    payload = {"model": args.model, "max_new_tokens": args.max_new_tokens, "prompt_sets": list(PROMPT_SETS),
               "docs": docs}
    # mtime=0: the same answers give the same bytes
    path.write_bytes(gzip.compress(json.dumps(payload, separators=(",", ":")).encode(), mtime=0))
    print(f"wrote {path}: {len(docs)} answers, {sum(map(len, docs))} tokens, {path.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
