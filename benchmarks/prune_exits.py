"""Issue 17: score Speculative Streaming's pruning exit against a tuned exit at the same layer (N - N_s).

Both read the layer-(N - N_s) states of 12 corpus windows that neither was fitted on (windows 1500..1511 of the
shuffled stdlib + pydoc-topics corpus: the shipped 1.5B adapter trained on windows 12..1499, the tuned exit on 132
of windows 0..131), against the q4 model's own greedy next tokens. The pruning rule keeps a tree edge iff the exit
gives its child p >= 0.05, so next to top-k and NLL it reports how often the model's own token survives and how
many tokens would. ``python benchmarks/prune_exits.py EXIT_FOLDER`` (from `mirrorsd train-exit --layers 24`).
"""

from __future__ import annotations

import json
import sys

import torch

import mirrorsd
from mirrorsd.decoding.streams.adapters import load_adapters
from mirrorsd.exit_heads import ExitTranslators
from mirrorsd.training import corpus_texts, make_chunks

MODEL = "qwen2.5-coder-1.5b"
THRESHOLD = 0.05  # ss's default pruning threshold


def main(exit_folder: str) -> None:
    loaded = mirrorsd.load_model(MODEL)
    model = loaded.model
    adapters = load_adapters(model, MODEL)
    layer = adapters.first_layer
    tuned = ExitTranslators.load(exit_folder)
    tuned.check(layer, model.config.hidden_size)
    windows = make_chunks(loaded.tokenizer, corpus_texts(["stdlib", "pydoc-topics"]), 256, 1512, 0)[1500:]
    exits = {"lens": lambda h: h, "prune adapter": adapters.prune, "tuned exit": lambda h: tuned(h, layer)}
    log_probs: dict[str, list[torch.Tensor]] = {name: [] for name in exits}
    labels = []
    with torch.inference_mode():
        for window in windows:
            ids = window.ids[None]
            positions = torch.arange(ids.shape[1])[None]
            cache = model.new_cache(capacity=ids.shape[1])
            hidden = model.run_layers(model.embed(ids), positions, cache, None, 0, layer)
            final = model.run_layers(hidden, positions, cache, None, layer, None)
            labels.append(model.logits(final[0]).argmax(-1))
            for name, exit_state in exits.items():
                log_probs[name].append(model.logits(exit_state(hidden[0])).log_softmax(-1))
    want = torch.cat(labels)
    report: dict[str, object] = {"tokens": len(want), "layer": layer}
    for name, parts in log_probs.items():
        lp = torch.cat(parts)
        top = lp.topk(3, -1).indices
        own = lp.gather(1, want[:, None])[:, 0]
        report[name] = {"top1": round((top[:, 0] == want).float().mean().item(), 4),
                        "top3": round((top == want[:, None]).any(-1).float().mean().item(), 4),
                        "nll": round(-own.mean().item(), 3),
                        "own_token_survives": round((own.exp() >= THRESHOLD).float().mean().item(), 4),
                        "tokens_above_threshold": round((lp.exp() >= THRESHOLD).sum(-1).float().mean().item(), 2)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
