"""A draft model's chain acceptance on a `mirrorsd train-eagle` feature cache's held-out windows: the share of start
positions (whose tokens the target wrote) where the draft's first j + 1 teacher-forced greedy tokens all equal the
target's, the metric `train-eagle` reports for its head, so the two compare on the same windows.

    python benchmarks/draft_chain.py CACHE [--depth 4] [--drafts qwen2.5-coder-0.5b ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import mirrorsd
from mirrorsd.train_eagle import FeatureCache, chain, step_labels
from mirrorsd.training import HELD_OUT


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cache", help="a train-eagle feature cache folder")
    p.add_argument("--depth", type=int, default=4, help="chain length")
    p.add_argument("--drafts", nargs="+", default=["qwen2.5-coder-0.5b"], help="draft models (zoo names or folders)")
    args = p.parse_args()
    items = FeatureCache([Path(args.cache) / HELD_OUT], "cpu")
    for name in args.drafts:
        draft = mirrorsd.load_model(name).model
        right, total = [0] * args.depth, 0
        with torch.inference_mode():
            for item in items:
                predicted = draft(item.ids[None])[0].argmax(-1)  # the draft's token after each position
                labels = step_labels(item, args.depth, answers_only=True)
                got, count = chain([predicted[1 + j:] == lab for j, lab in enumerate(labels)], labels)
                right = [a + b for a, b in zip(right, got, strict=True)]
                total += count
        accept = [round(r / max(1, total), 4) for r in right]
        print(json.dumps({"draft": name, "accept": accept, "tokens_per_pass": round(1 + sum(accept), 4),
                          "positions": total}))


if __name__ == "__main__":
    main()
