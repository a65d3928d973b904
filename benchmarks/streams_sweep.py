"""Issue 17: choose the stream adapters' rank and N_s by measurement, at an equal budget on the 1.5B.

Trains one adapter per configuration with `mirrorsd train-streams` (160 windows of 256 tokens, one epoch, the same
12 held-out windows; configurations with the same N_s share one state cache), then writes the held-out curves to
``docs/streams_sweep_1.5b.json`` and a plot to ``docs/streams_sweep_1.5b.png``. Resumable: a finished
configuration is skipped. ``python benchmarks/streams_sweep.py OUT`` (~45 min on the 2-core VM).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CONFIGS = {"ns4-r16": (4, 16), "ns4-r8": (4, 8), "ns4-r32": (4, 32), "ns2-r16": (2, 16), "ns6-r16": (6, 16)}
COMMON = ["--model", "qwen2.5-coder-1.5b", "--data", "stdlib", "pydoc-topics", "--seq-len", "256", "--held-out", "12",
          "--chunks", "160", "--steps", "160", "--lr", "1e-3", "--eval-every", "40"]
DOCS = Path(__file__).resolve().parent.parent / "docs"


def main(out: Path) -> None:
    curves = {}
    for name, (layers, rank) in CONFIGS.items():
        folder = out / name
        if not (folder / "stream_config.json").exists():
            subprocess.run([sys.executable, "-m", "mirrorsd.cli", "train-streams", *COMMON, "--out", str(folder),
                            "--cache", str(out / f"cache-ns{layers}"), "--layers", str(layers), "--rank", str(rank)],
                           check=True)
        curves[name] = {"layers": layers, "rank": rank,
                        "curve": json.loads((folder / "curve.json").read_text())}
    (DOCS / "streams_sweep_1.5b.json").write_text(json.dumps(curves, indent=1) + "\n")
    plot(curves, DOCS / "streams_sweep_1.5b.png")


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for run in curves.values():
        xs = [p["train_tokens"] for p in run["curve"]]
        label = f"N_s = {run['layers']}, rank {run['rank']}"
        left.plot(xs, [p["stream_accuracy"][0] for p in run["curve"]], "o-", label=label)
        right.plot(xs, [p["prune_accuracy"] for p in run["curve"]], "s--", label=label)
    for ax, what in ((left, "stream 1 (token t+2)"), (right, "pruning exit, layer N - N_s (t+1)")):
        ax.set_xlabel("training tokens")
        ax.set_ylabel(f"held-out top-1: {what}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Qwen2.5-Coder-1.5B stream adapters at an equal budget (160 x 256 tokens)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
