"""Perplexity on an offline corpus: how much a weight format (q8, q4) costs in quality against fp32.

The corpus is Python standard-library source that every Python install carries (code with docstrings and
comments, the Coder models' home ground), read from a fixed module list so that every run scores the same
text. Text is cut into non-overlapping windows scored with teacher forcing; perplexity is exp(mean NLL)
over all predicted tokens.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .model import Transformer

#: Fixed modules, so the corpus only changes with the Python version (recorded in the report).
CORPUS_MODULES = ("textwrap", "heapq", "bisect", "fractions", "statistics", "shlex", "json.decoder", "difflib",
                  "string", "colorsys", "calendar", "functools")


def corpus_text(modules: tuple[str, ...] = CORPUS_MODULES) -> str:
    import importlib

    return "\n\n".join(inspect.getsource(importlib.import_module(name)) for name in modules)


@dataclass
class PerplexityReport:
    model: str
    weights: str
    perplexity: float
    tokens: int
    window: int
    corpus: str
    activations: str = "int8"  # (of the quantized formats: fp32 weights take fp32 activations)

    def to_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def perplexity(model: Transformer, token_ids: list[int], window: int = 512, progress: bool = True) -> float:
    """exp(mean next-token NLL) over non-overlapping windows of ``window`` tokens."""
    if window < 2:
        raise ValueError("window must be at least 2 tokens")
    total_nll, count = 0.0, 0
    starts = range(0, len(token_ids) - 1, window)
    for start in tqdm(starts, desc="perplexity", unit="window", disable=not progress):
        chunk = torch.tensor([token_ids[start : start + window]], device=model.device)
        if chunk.shape[1] < 2:
            break
        logits = model(chunk)[0, :-1].float()
        nll = F.cross_entropy(logits, chunk[0, 1:], reduction="sum")
        total_nll += nll.item()
        count += chunk.shape[1] - 1
    return math.exp(total_nll / count)


def run(name: str, weights: str, max_tokens: int = 4096, window: int = 512,
        progress: bool = True, activations: str = "int8") -> PerplexityReport:
    """Score a zoo model (or folder) in one weight format on the first ``max_tokens`` corpus tokens."""
    import platform

    from transformers import AutoTokenizer

    from .zoo import resolve

    path = resolve(name, progress=progress)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tokenizer(corpus_text(), add_special_tokens=False)["input_ids"][:max_tokens]
    model = Transformer.from_pretrained(path, weights=weights, activations=activations)
    value = perplexity(model, ids, window, progress)
    corpus = f"Python {platform.python_version()} stdlib: {', '.join(CORPUS_MODULES)}"
    return PerplexityReport(name, weights, round(value, 4), len(ids), window, corpus,
                            "fp32" if weights == "fp32" else activations)
