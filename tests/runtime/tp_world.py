"""One rank of the tensor-parallel world of ``test_mirror_processes.py``: ``torchrun --nproc-per-node 3`` runs
it with ranks 0-1 holding a target sharded over both (``--target-tp 2``) and rank 2 the draft. Each target rank
writes what it decoded to ``OUT/rank<r>.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mirrorsd import generate
from mirrorsd.decoding.mirror.remote import leave_launched_world, serve_launched
from mirrorsd.model import Transformer
from mirrorsd.runtime.tensor_parallel import gather_spans, launched_world, shard_target
from tests.helpers import tiny_hf

TP = 2
PROMPT = [5, 9, 2, 7, 3]


def main(out: Path) -> None:
    world = launched_world(TP)
    draft = Transformer.from_hf(tiny_hf(layers=2, seed=2), linear="dense")
    if world.rank == world.draft_rank:
        serve_launched(draft, TP)
        return
    whole = Transformer.from_hf(tiny_hf(layers=4, seed=1), linear="dense")
    target = shard_target(Transformer.from_hf(tiny_hf(layers=4, seed=1), linear="dense"), world.tp_group)
    mirror = dict(method="mirror", draft=draft, backend="processes", gamma=3, kappa=2, exit_layer=2,
                  roots="paper", confidence=0.0)  # a random draft is rarely sure: full windows draft something
    rows = {"unsharded_ar": generate(whole, PROMPT, method="ar", max_new_tokens=24).token_ids}
    spans = []
    for label, kw in (("greedy", {}), ("seeded", {"temperature": 0.9, "seed": 11})):
        rows[f"ar_{label}"] = generate(target, PROMPT, method="ar", max_new_tokens=24, **kw).token_ids
        got = generate(target, PROMPT, max_new_tokens=24, **mirror, **kw)
        stats = got.stats.extra["mirror"]
        rows[f"mirror_{label}"] = got.token_ids
        rows[f"mirror_{label}_failed"] = stats.draft_failed
        rows[f"mirror_{label}_steps"] = len(got.stats.step_log)
        spans += got.stats.spans
    rows["trace_lanes"] = sorted({s.lane for s in gather_spans(spans, world)})  # rank 0's; [] elsewhere
    try:
        generate(target, PROMPT, method="sd", draft=draft, max_new_tokens=4)  # suffix_match=3 by default
    except ValueError as error:
        rows["refused"] = str(error)
    try:  # the self-draft's all-reduces would run on the worker thread beside the target's, on one group
        generate(target, PROMPT, max_new_tokens=4, **mirror | {"draft": target.prefix_model(2), "backend": "threads"})
    except ValueError as error:
        rows["self_draft_refused"] = str(error)
    mixed = Transformer.from_hf(tiny_hf(layers=4, seed=1), linear="dense")
    mixed.layers[1].mlp.down_proj = Transformer.from_hf(tiny_hf(layers=4, seed=1)).layers[1].mlp.down_proj
    for label, model in (("quantized_refused", mixed), ("sharded_refused", target)):
        try:
            shard_target(model, world.tp_group)
        except ValueError as error:
            rows[label] = str(error)
    rows["refused_left_whole"] = mixed.layers[0].self_attn.n_heads == mixed.config.n_heads == 4
    rows["local_heads"] = [target.layers[0].self_attn.n_heads, target.layers[0].self_attn.n_kv_heads]
    (out / f"rank{world.rank}.json").write_text(json.dumps(rows))
    leave_launched_world()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
