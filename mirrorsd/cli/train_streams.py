"""``mirrorsd train-streams``: Speculative Streaming adapters for a frozen model, trained on offline text."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import mirrorsd
from mirrorsd.train_streams import LOSSES, train

from .args import COMMANDS, add_model, add_training, count
from .common import HelpFormatter, training_dtype, warn_if_busy


def register(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "train-streams", formatter_class=HelpFormatter, help=COMMANDS["train-streams"],
        description="Train stream embeddings, stream-row LoRA adapters (peft) on the top N_s layers and the "
        "pruning adapter for a model whose base weights stay frozen (so its own tokens cannot change). The model "
        "decoding runs fills a state cache once (layer N - N_s states, the top layers' keys/values and its own "
        "greedy tokens as labels, ~7 KB/token on the 1.5B); training then runs epochs over the cache, pushing only "
        "the stream rows through bf16 copies of the top layers and a restricted-vocabulary head. Resumes from "
        "OUT/checkpoint.pt and the cache's finished shards; saves a learning curve (OUT/learning_curve.png).")
    add_model(t, required=True)
    t.add_argument("--data", nargs="+", required=True,
                   help="text files or folders (*.py/*.txt/*.md/*.rst), or corpus names: stdlib (this Python's "
                        "standard library source), pydoc-topics (the language reference), chat-answers (the model's "
                        "own greedy answers to mirrorsd's shipped chat prompts, through its chat template), or "
                        "distill:FOLDER (a `mirrorsd distill` folder: the model's answers as token ids)")
    t.add_argument("--out", required=True, help="folder for stream_config.json + adapter.safetensors")
    t.add_argument("--cache", help="state cache folder (default: OUT/cache); reused by later runs with the same "
                                   "model, data, --seq-len, --chunks, --held-out, --self-distill, --layers, --seed")
    t.add_argument("--streams", type=count(1), default=3, help="γ speculative streams")
    t.add_argument("--layers", type=count(1), default=4, help="N_s: top layers with multi-stream attention")
    t.add_argument("--rank", type=count(1), default=8, help="LoRA rank of the stream-row adapters")
    add_training(t, seq_len=128, lr=1e-3, held_out=8, measured="stream accuracy", trained="adapters")
    t.add_argument("--self-distill", type=int, default=0, metavar="N",
                   help="replace N training chunks by the model's own greedy continuations of their first tokens "
                        "(the text decoding will actually ask the streams to predict)")
    t.add_argument("--init", metavar="ADAPTER", help="start from this adapter folder (same --streams and "
                   "--rank) to train it further, e.g. on more --chunks; its N_s may be smaller than --layers: its "
                   "layers keep their weights and the new lower ones start from the base layers")
    t.add_argument("--loss", choices=LOSSES, default="ce",
                   help="the streams' loss: ce, cross-entropy on the model's greedy token (what greedy verification "
                        "accepts); kl, forward KL to the model's own next-token distribution (soft targets: also "
                        "how sure the model is; recomputes the main rows' top layers, +7%% a step on the 0.5B)")
    t.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    warn_if_busy("train-streams")
    decode = mirrorsd.load_model(args.model, device=args.device)  # the model decoding will run (q4 on CPU)
    print(f"mirrorsd: the state cache comes from {decode.name} {decode.format}", file=sys.stderr, flush=True)
    # The stream rows are trained through dense, autograd-capable copies of the frozen weights.
    tower = mirrorsd.load_model(args.model, device=args.device, dtype=training_dtype(args.dtype, args.device),
                                weights="fp32", linear="dense",
                                progress=False)
    recipe = {"command": "mirrorsd train-streams " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else []),
              "model": args.model, "data": args.data}
    summary = train(tower.model, decode.model, decode.tokenizer, args.data, Path(args.out), model_name=args.model,
                    decode_format=decode.format, cache=Path(args.cache) if args.cache else None,
                    streams=args.streams, layers=args.layers, rank=args.rank, steps=args.steps, chunks=args.chunks,
                    seq_len=args.seq_len, lr=args.lr,
                    held_out=args.held_out, distill=args.self_distill, vocab=args.vocab,
                    eval_every=args.eval_every, seed=args.seed, init=Path(args.init) if args.init else None,
                    loss=args.loss, recipe=recipe)
    print(json.dumps(summary, indent=2))
    return 0
