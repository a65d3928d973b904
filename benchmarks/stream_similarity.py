"""The Speculative Streaming paper's Fig. 12 (PMLR) on our models: how close each stream's state comes, layer by
layer through the MSA layers, to the main stream's state at the position whose token it predicts.

Stream j (from 1) at position t is trained to predict token t + 1 + j, the token the main row at t + j predicts;
so its "true next-token residual" at layer l is the main row's state at t + j, layer l. The paper draws the
cosine between the two from the layer where streams are inserted to the last one (0.6 at the top of a 32-layer
model, streams from layer 15), and Medusa's head, which sees only the last layer, below it. We draw beside each
stream the state it starts from, the main row at t (what a stream without MSA layers, like a Medusa head, has to
work with) against the same target. Residual states share a large common direction (the same few outsized
channels at every position), which lifts every raw cosine; the centred cosine removes each layer's mean main state
over the window first, so it scores only what sets positions apart.

The windows are the target's own distilled answers from shards of ``data/distill/<target>`` made after every
shipped adapter was trained, read teacher-forced through the q4 model decoding uses; positions count where
the predicted token is one the model wrote (decoding only ever drafts those)::

    python benchmarks/stream_similarity.py --models qwen2.5-coder-1.5b qwen2.5-coder-0.5b --json OUT.json --plot OUT.png
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import mirrorsd
from mirrorsd.decoding.streams.adapters import load_adapters, msa_mask
from mirrorsd.training import distill_documents, make_chunks

DATA = Path("data/distill/qwen2.5-coder-1.5b")


def held_out_windows(tokenizer, shards: range, windows: int, seq_len: int) -> list:
    """``windows`` windows of the distilled ``shards`` (a folder of links: the reader takes folders)."""
    with tempfile.TemporaryDirectory() as folder:
        for index in shards:
            shard = DATA / f"shard-{index:05d}.npz"
            (Path(folder) / shard.name).symlink_to(shard.resolve(strict=True))
        return make_chunks(tokenizer, distill_documents(folder), seq_len, windows, seed=0)


@torch.inference_mode()
def layer_states(model, adapters, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer from the insertion layer to the last (input first): the main rows' states ``[T, h]`` and the
    stream rows' ``[T, γ, h]``, the streams run one layer at a time over the main rows' cached keys/values."""
    n, streams, first = ids.shape[0], adapters.config.streams, adapters.first_layer
    positions = torch.arange(n)[None]
    cache = model.new_cache(capacity=n * (1 + streams))
    hidden = model.run_layers(model.embed(ids[None]), positions, cache, None, 0, first)
    main = [hidden[0]]
    for layer in range(first, model.config.n_layers):
        main.append(model.run_layers(main[-1][None], positions, cache, None, layer, layer + 1)[0])
    rows = adapters.insert(hidden)[:, n:]
    stream_positions = torch.arange(n).repeat_interleave(streams)[None]
    mask = msa_mask(torch.ones(n, n, dtype=torch.bool).tril(), 0, streams)[:, n:]
    stream = [rows[0]]
    for layer in range(first, model.config.n_layers):
        for i in range(first, model.config.n_layers):  # the main keys only: a layer's stream keys are not kept
            cache.lengths[i] = n
        stream.append(model.run_layers(stream[-1][None], stream_positions, cache, mask, layer, layer + 1,
                                       streams=adapters.rows(n * streams))[0])
    return main, [s.view(n, streams, -1) for s in stream]


def similarity(name: str, shards: range, windows: int, seq_len: int) -> dict:
    loaded = mirrorsd.load_model(name, progress=False)
    model, adapters = loaded.model, load_adapters(loaded.model, name)
    gamma, first = adapters.config.streams, adapters.first_layer
    depth = model.config.n_layers - first + 1
    sums = {f"{key}{kind}": torch.zeros(gamma, depth) for key in ("stream", "start") for kind in ("", "_centered")}
    counts = torch.zeros(gamma)
    top1_hits = torch.zeros(gamma)
    for chunk in held_out_windows(loaded.tokenizer, shards, windows, seq_len):
        main, stream = layer_states(model, adapters, chunk.ids)
        n = chunk.ids.shape[0]
        labels = model.logits(main[-1]).argmax(-1)
        predicted = model.logits(stream[-1]).argmax(-1)  # [T, γ]
        for j in range(1, gamma + 1):
            t = torch.arange(1, n - 1 - j)  # (position 0 holds the attention sink's outsized state: left out)
            written = chunk.answer[t + 1 + j] if chunk.answer is not None else torch.ones_like(t, dtype=torch.bool)
            t = t[written]
            counts[j - 1] += len(t)
            top1_hits[j - 1] += float((predicted[t, j - 1] == labels[t + j]).sum())
            for depth_i in range(depth):
                for kind, centre in (("", 0.0), ("_centered", main[depth_i][1:].float().mean(0))):
                    target = main[depth_i][t + j].float() - centre
                    for key, state in (("stream", stream[depth_i][t, j - 1]), ("start", main[depth_i][t])):
                        cosine = F.cosine_similarity(state.float() - centre, target, dim=-1)
                        sums[f"{key}{kind}"][j - 1, depth_i] += float(cosine.sum())
    mean = {key: [[round(x, 4) for x in row] for row in (value / counts[:, None]).tolist()]
            for key, value in sums.items()}
    return {"model": name, "n_layers": model.config.n_layers, "first_layer": first, "streams": gamma,
            "layers": list(range(first, model.config.n_layers + 1)), "positions_per_stream": counts.tolist(),
            "cosine_stream": mean["stream"], "cosine_main_at_t": mean["start"],
            "cosine_stream_centered": mean["stream_centered"], "cosine_main_at_t_centered": mean["start_centered"],
            "stream_top1": [round(x, 4) for x in (top1_hits / counts).tolist()]}


def plot(results: list[dict], path: Path) -> None:
    """One column per model: the raw cosine (the paper's measure) above, the centred one below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(5.2 * len(results), 7.2), squeeze=False)
    for column, r in enumerate(results):
        for ax, kind in zip(axes[:, column], ("", "_centered"), strict=True):
            pairs = zip(r[f"cosine_stream{kind}"], r[f"cosine_main_at_t{kind}"], strict=True)
            for j, (ours, start) in enumerate(pairs):
                label = f"stream {j + 1} at t (token t+{j + 2}) vs main t+{j + 1}"
                line, = ax.plot(r["layers"], ours, "o-", label=label)
                ax.plot(r["layers"], start, "s--", color=line.get_color(), alpha=0.6,
                        label="main row at t vs the same (no MSA layers)" if j == 0 else None)
            ax.set_xlabel(f"layer (streams inserted at {r['first_layer']} of {r['n_layers']})")
            ax.set_ylabel(("centred " if kind else "") + "cosine to main row t+j")
            ax.set_ylim(0, 1)
            ax.set_xticks(r["layers"])
            ax.set_title(f"{r['model']}: {'centred (window mean removed)' if kind else 'raw, as the paper'}",
                         fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
    p.add_argument("--shards", default="81-84", help="the distilled shards that supply the windows (the default: "
                   "made 2026-11-30, after every shipped adapter was trained)")
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args()
    first, last = map(int, args.shards.split("-"))
    results = [similarity(name, range(first, last + 1), args.windows, args.seq_len) for name in args.models]
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
