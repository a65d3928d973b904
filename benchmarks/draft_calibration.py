"""Drafts on a ``train-draft`` cache's held-out windows, offline: agreement with the target, how often each is sure
under ``sd``'s confidence rule and how often right when sure, and greedy ``sd`` trajectories (γ = 20) teacher-forced
on the target's own answers (exact while the draft agrees): tokens per step (MAT) and drafted tokens per step, per
threshold. No timing: it tells which threshold and which draft are worth a benchmark.

Usage: ``python benchmarks/draft_calibration.py CACHE [TUNED_DRAFT ...] [--model qwen2.5-coder-0.5b] [--out FILE]``
(the stock draft is always the first row; CACHE is a ``train-draft --cache`` folder of the same layers)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

import mirrorsd
from mirrorsd import tuned_drafts as td
from mirrorsd.train_draft import DraftCache, DraftLoRA, calibration, loss_labels, top_forward
from mirrorsd.training import HELD_OUT

THRESHOLDS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
GAMMA = 20


def trajectories(sequences: list[tuple[list[float], list[bool], list[bool]]], confidence: float) -> dict[str, float]:
    """Greedy sd over each window's answer positions: a step drafts until a miss, a token below ``confidence`` (still
    drafted) or γ, and commits the accepted tokens plus the target's own."""
    steps = tokens = drafted = 0
    for top, right, written in sequences:
        at = 0
        while at < len(top):
            if not written[at]:
                at += 1
                continue
            accepted = window = 0
            while at + window < len(top) and written[at + window] and window < GAMMA:
                window += 1
                if not right[at + window - 1]:
                    break
                accepted += 1
                if top[at + window - 1] < confidence:
                    break
            steps, tokens, drafted = steps + 1, tokens + accepted + 1, drafted + window
            at += accepted + 1
    return {"mat": round(tokens / steps, 3), "drafted": round(drafted / steps, 3),
            "accepted_per_drafted": round((tokens - steps) / max(1, drafted), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cache", type=Path)
    parser.add_argument("drafts", nargs="*", help="tuned-draft folders")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="the base draft")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    first = json.loads((args.cache / "cache.json").read_text())["first_layer"]
    results = {}
    for name in ["stock", *args.drafts]:
        tower = mirrorsd.load_model(args.model, dtype=torch.bfloat16, weights="fp32", linear="dense",
                                    progress=False).model.requires_grad_(False)
        config = None if name == "stock" else td.load_config(td.resolve(name))
        layers = tower.config.n_layers - first if config is None else config.layers
        if tower.config.n_layers - layers != first:
            raise ValueError(f"{name} tunes {layers} layers; the cache holds layer {first} states")
        lora = DraftLoRA(tower, layers, 16 if config is None else config.rank, 32 if config is None else config.alpha)
        lora.load_state({k: torch.zeros_like(v) for k, v in lora.state().items()} if config is None
                        else load_file(str(Path(name) / "lora.safetensors")))
        held = DraftCache([args.cache / HELD_OUT], tower.device)
        sequences = []
        with torch.no_grad():
            for item in held:
                top, predicted = torch.softmax(tower.logits(top_forward(tower, first, item)).float(), -1).max(-1)
                labels = loss_labels(item, True)
                sequences.append((top.tolist(), (predicted == labels).tolist(), (labels >= 0).tolist()))
        top, right, written = (torch.tensor([x for seq in sequences for x in seq[i]]) for i in range(3))
        results[name] = {"agreement": round(int(right[written].sum()) / int(written.sum()), 4)} | {
            str(c): calibration(top, right, written, c) | trajectories(sequences, c) for c in THRESHOLDS}
        print(name, json.dumps(results[name]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
