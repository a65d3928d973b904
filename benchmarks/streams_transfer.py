"""Do stream adapters that gain on distilled answers gain on Spec-Bench's answers too? Held-out top-1 of every stream
(teacher-forced, against the model's own greedy tokens, full vocabulary: ``train_streams.evaluate``) for each adapter,
on two sets of windows: distilled records from a folder's newest shards (``--distill``; shards an adapter trained
on earlier do not reach them), and the model's own greedy answers to a Spec-Bench subset's first turns. Both sets
mark which tokens the model wrote, and ``stream_accuracy_answers`` is measured on those alone, as decoding asks.

Usage: ``python benchmarks/streams_transfer.py --adapters chat=FOLDER shipped=mirrorsd/data/streams/qwen2.5-coder-1.5b
[--model qwen2.5-coder-1.5b] [--distill [LABEL=]data/distill/qwen2.5-coder-1.5b ...] [--suite specbench:2]
[--json OUT]``"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

import mirrorsd
from mirrorsd.api import encode_prompt
from mirrorsd.decoding.streams.adapters import CONFIG_FILE, StreamAdapters, StreamConfig
from mirrorsd.specbench import load_suite
from mirrorsd.train_streams import Cached, evaluate, freeze, warm_start
from mirrorsd.training import Chunk


def distilled_chunks(folder: Path, shards: int, count: int, max_len: int) -> list[Chunk]:
    """The first ``count`` records of the folder's last ``shards`` shards, each cut to ``max_len`` tokens."""
    chunks: list[Chunk] = []
    for shard in sorted(folder.glob("shard-*.npz"))[-shards:]:
        data = np.load(shard)
        for start, answer, end in zip(data["start"], data["answer"], data["end"], strict=True):
            ids = torch.from_numpy(data["tokens"][start:end][:max_len].astype(np.int64))
            written = torch.zeros(len(ids), dtype=torch.bool)
            written[int(answer - start):] = True
            chunks.append(Chunk(ids, 0, written))
            if len(chunks) == count:
                return chunks
    return chunks


def specbench_chunks(decode: mirrorsd.LoadedModel, suite: str, answer_tokens: int, max_prompt: int) -> list[Chunk]:
    """Each first turn through the chat template (its last ``max_prompt`` tokens) and the model's greedy answer."""
    chunks = []
    for question in load_suite(suite):
        prompt = encode_prompt(decode, [{"role": "user", "content": question.turns[0]}])[-max_prompt:]
        answer = mirrorsd.generate(decode, prompt, max_new_tokens=answer_tokens).token_ids
        written = torch.zeros(len(prompt) + len(answer), dtype=torch.bool)
        written[len(prompt):] = True
        chunks.append(Chunk(torch.tensor(prompt + answer), 0, written))
    return chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--adapters", nargs="+", required=True, help="LABEL=FOLDER stream adapters of the model")
    parser.add_argument("--distill", nargs="+", default=[], metavar="[LABEL=]FOLDER",
                        help="`mirrorsd distill` folders of the model's answers (or folders of links to some of "
                             "their shards), each a set of windows")
    parser.add_argument("--shards", type=int, default=3, help="its newest shards read")
    parser.add_argument("--windows", type=int, default=24, help="distilled records read")
    parser.add_argument("--suite", default="specbench:2")
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    torch.manual_seed(0)
    decode = mirrorsd.load_model(args.model, progress=False)  # the states decoding sees
    tower = mirrorsd.load_model(args.model, weights="fp32", linear="dense", dtype=torch.float32, progress=False)
    tower.model.requires_grad_(False)
    adapters = dict(a.split("=", 1) for a in args.adapters)
    raw = {}
    for source in args.distill:
        label, folder = source.split("=", 1) if "=" in source else ("distilled", source)
        raw[f"{label}, newest {args.shards} shards"] = distilled_chunks(Path(folder), args.shards, args.windows, 384)
    raw[f"{args.suite} answers"] = specbench_chunks(decode, args.suite, args.answer_tokens, 448)
    out: dict = {"model": args.model, "windows": {name: len(chunks) for name, chunks in raw.items()},
                 "written_tokens": {name: int(sum(c.answer.sum() for c in chunks)) for name, chunks in raw.items()}}
    by_first: dict[int, dict[str, list[Cached]]] = {}  # adapters of another N_s read the states of another layer

    def cached(first: int, chunk: Chunk) -> Cached:
        row = freeze(decode.model, first, chunk)
        return Cached(row["hidden"], row["keys"], row["values"], row["labels"].long(), int(row["loss_from"]),
                      row["answer"].bool())

    for label, folder in adapters.items():
        saved = StreamConfig(**json.loads((Path(folder) / CONFIG_FILE).read_text()))
        streams = StreamAdapters(tower.model, saved)
        if streams.first_layer not in by_first:
            by_first[streams.first_layer] = {name: [cached(streams.first_layer, c) for c in chunks]
                                             for name, chunks in raw.items()}
        warm_start(tower.model, streams, Path(folder))
        with torch.no_grad():
            out[label] = {name: evaluate(tower.model, streams, items)
                          for name, items in by_first[streams.first_layer].items()}
        print(label, json.dumps(out[label]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
