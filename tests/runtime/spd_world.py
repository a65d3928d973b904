"""One rank of the sharded-draft world of ``test_mirror_processes.py``: ``torchrun --nproc-per-node 3`` runs it with
rank 0 holding the target and ranks 1-2 a draft sharded over both (``--draft-tp 2``) in the ``spd`` or ``layer``
form. Rank 0 writes what it decoded to ``OUT/rank0.json``, rank 1 what its sharded draft computes (against the
whole draft and against :func:`run_tracks`, the spd form in one process) to ``OUT/rank1.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from mirrorsd import generate
from mirrorsd.decoding.mirror.remote import leave_launched_world, serve_launched
from mirrorsd.model import Transformer
from mirrorsd.runtime.tensor_parallel import launched_world, run_tracks, shard_draft
from tests.helpers import tiny_hf

PROMPT = [5, 9, 2, 7, 3]


def draft_model() -> Transformer:
    return Transformer.from_hf(tiny_hf(layers=4, seed=2), linear="dense")


def main(out: Path, syncs: str) -> None:
    world = launched_world(1, 2)
    if world.holds_draft:
        whole, draft = draft_model(), draft_model()
        count = shard_draft(draft, world.draft_group, syncs)
        with torch.inference_mode():
            want = whole(torch.tensor([PROMPT]), cache=whole.new_cache(capacity=16))
            got = draft(torch.tensor([PROMPT]), cache=draft.new_cache(capacity=16))
            # the spd form as train-draft computes it in one process (what a draft trained for it learns)
            one_process = whole.logits(run_tracks(whole, whole.embed(torch.tensor([PROMPT])),
                                                  torch.arange(len(PROMPT))[None], 0, 4, 2))
        if world.rank == world.draft_rank:
            (out / "rank1.json").write_text(json.dumps({"all_reduces": count.count,
                                                        "gap": (got - want).abs().max().item(),
                                                        "tracks_gap": (got - one_process).abs().max().item()}))
        serve_launched(draft, 1, 2, count)
        return
    target = Transformer.from_hf(tiny_hf(layers=4, seed=1), linear="dense")
    mirror = dict(method="mirror", draft=draft_model(), backend="processes", gamma=3, kappa=2, exit_layer=2,
                  roots="paper", confidence=0.0)  # a random draft is rarely sure: full windows draft something
    rows = {}
    for label, kw in (("greedy", {}), ("seeded", {"temperature": 0.9, "seed": 11})):
        rows[f"ar_{label}"] = generate(target, PROMPT, method="ar", max_new_tokens=24, **kw).token_ids
        got = generate(target, PROMPT, max_new_tokens=24, **mirror, **kw)
        stats = got.stats.extra["mirror"].to_dict()
        rows[f"mirror_{label}"] = got.token_ids
        rows[f"mirror_{label}_failed"] = stats["draft_failed"]
        rows[f"mirror_{label}_per_forward"] = stats["draft_all_reduces_per_forward"]
        rows[f"mirror_{label}_ms"] = stats["draft_all_reduce_ms"]
        rows[f"mirror_{label}_traced"] = sum(s.args.get("all_reduces", 0) for s in got.stats.spans)
        rows[f"mirror_{label}_counted"] = stats["draft_all_reduces"]
    (out / "rank0.json").write_text(json.dumps(rows))
    leave_launched_world()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
