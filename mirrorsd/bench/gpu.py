"""`mirrorsd bench gpu`: validate a CUDA machine in one command (issue 21).

Only small files travel to a lent GPU machine, so the models are random weights of real shapes generated on the
device (Qwen2.5-1.5B- and 7B-shaped targets, a 0.5B-shaped draft). The command

1. runs the CUDA-gated tests (``tests/test_cuda.py``) when the repository's tests are at hand;
2. times the k-token forward curve of each target;
3. runs every method on the same weights and checks its tokens against ``ar`` (a divergence is reported with the
   target's recomputed logit gap, never silently allowed);
4. forces acceptance lengths with an oracle draft (:class:`OracleDraft`: the real draft network runs, so its cost
   is real, but its tokens follow the target's greedy answer for ``A`` tokens and then miss) and measures
   Mirror-SD's step time next to its Eq. 10 terms, the hidden-draft fraction and a Chrome trace, against
   vanilla SD at the same acceptance.

Without CUDA it is a dry run on tiny shapes (CPU, fp32): every step runs, the numbers mean nothing.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..api import generate, stream
from ..cuda_graphs import cuda_graphs
from ..decoding.streams.adapters import StreamAdapters, StreamConfig
from ..model import Transformer
from ..runtime import synchronize, write_chrome_trace
from ..sampling import keyed_uniforms
from . import metrics
from .forward import forward_costs
from .runner import machine


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool


REAL_SHAPES = {
    "qwen2.5-0.5b": Shape(896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": Shape(1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-7b": Shape(3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-14b": Shape(5120, 13824, 48, 40, 8, 152064, False),  # ~30 GB in bf16: fits an H100
    "qwen2.5-32b": Shape(5120, 27648, 64, 40, 8, 152064, False),  # ~66 GB in bf16: fits an H200
}
#: The dry run's stand-ins: the same roles, small enough for a CPU test. Their head sizes are powers of two, as the
#: real models' are: the fused CUDA path (and so every CUDA graph) takes no other, and the CUDA tests build on these.
DRY_SHAPES = {
    "qwen2.5-0.5b": Shape(64, 128, 2, 4, 2, 512, True),
    "qwen2.5-1.5b": Shape(96, 192, 4, 6, 2, 512, True),
    "qwen2.5-7b": Shape(128, 256, 4, 4, 2, 512, False),
    "qwen2.5-14b": Shape(128, 256, 6, 4, 2, 512, False),
    "qwen2.5-32b": Shape(128, 320, 8, 4, 2, 512, False),
}
DRAFT = "qwen2.5-0.5b"  # built with each target's vocabulary size (the 7B pads its embedding to 152,064 rows)
TARGETS = ("qwen2.5-1.5b", "qwen2.5-7b")  # the default run
#: The Mirror-SD paper's target sizes, run on request (``--targets``): a lease's minutes go to the default run first.
LARGE_TARGETS = ("qwen2.5-14b", "qwen2.5-32b")
#: Tokens per generation on a GPU: the whole command (tests included) then fits one 10-minute call of a lent H200;
#: at 128 it ran past 7 minutes, Mirror-SD's host-bound steps (~0.25 s each) being most of it.
GPU_MAX_NEW = 48
#: Logit spread of the random LM heads: wide enough that greedy choices are rarely float near-ties.
LOGIT_STD = 8.0
#: A divergence whose recomputed logit gap is below this is float reordering (bf16 rounds a logit of ~10 by
#: ~0.04; fp32's allowance is the benchmark runner's 1e-3).
NEAR_TIE = {torch.bfloat16: 0.1, torch.float16: 0.02, torch.float32: 1e-3}


def random_model(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int) -> Transformer:
    """A Qwen2-architecture model with random weights made on ``device`` (nothing large crosses the wire)."""
    return Transformer.from_hf(random_hf(shape, device, dtype, seed), linear="dense")


def random_hf(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """:func:`random_model`'s HF transformers model: the peer, on the same weights."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, max_position_embeddings=4096,
                      tie_word_embeddings=shape.tied)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or p.dim() < 2:
                continue
            std = LOGIT_STD / math.sqrt(shape.hidden) if ("embed" in name or "lm_head" in name) \
                else 1 / math.sqrt(p.shape[1])
            p.normal_(0.0, std, generator=generator)
    return hf


class OracleDraft(Transformer):
    """A draft whose network runs for real but whose tokens follow a schedule: at generated position ``o`` it
    proposes the target's greedy token unless ``o % (accept + 1) == accept``, where it proposes another one.
    Every verification then accepts ``accept`` tokens (with a window of at least ``accept + 1``), which random
    weights cannot give. Each output row of :meth:`run_layers` carries its row index in hidden channels 0-1
    (base 256: exact even in bf16), so :meth:`logits` finds the row's position whichever rows a caller kept (SD's
    last row, Mirror-SD's tree rollouts) without the methods knowing about the oracle.

    ``stream_hit``: the draft's Speculative Streaming streams (:class:`OracleStreams`, untrained, so their own
    guesses never hold) guess right at that rate instead. Stream ``j`` of the node at position ``p`` guesses the
    token the schedule puts at ``p + 1 + j``, keyed by that position and ``j``; a wrong guess never holds it, at any
    rank. The draft's main stream verifies every guess, so the draft's tokens stay the schedule's, in fewer
    forwards."""

    whole_forward_graphs = False  # its tokens come from the two methods below, which a captured forward skips
    reference: torch.Tensor  # prompt + the target's greedy answer, on the draft's device
    prompt_len: int
    accept: int | None
    stream_hit: float | None
    _positions: torch.Tensor
    _streams: torch.Tensor  # per output row: 0 for a main row, else its stream index j

    @classmethod
    def wrap(cls, draft: Transformer, prompt: list[int], reference: list[int], accept: int | None,
             stream_hit: float | None = None) -> OracleDraft:
        oracle = cls.__new__(cls)
        oracle.__dict__.update(draft.__dict__)  # shares the draft's modules, buffers and config
        oracle.reference = torch.tensor([*prompt, *reference], device=draft.device)
        oracle.prompt_len, oracle.accept, oracle.stream_hit = len(prompt), accept, stream_hit
        return oracle

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, *args: Any, streams: Any = None,
                   **kwargs: Any) -> torch.Tensor:
        out = super().run_layers(hidden, positions, *args, streams=streams, **kwargs).clone()
        self._positions = positions.expand(out.shape[:-1]).reshape(-1)
        index = torch.arange(self._positions.numel(), device=out.device).view(out.shape[:-1])
        out[..., 0], out[..., 1] = (index % 256).to(out.dtype), (index // 256).to(out.dtype)
        stream = torch.zeros(out.shape[:-1], dtype=torch.long, device=out.device)
        if streams is not None and streams.count:  # the trailing rows: stream (i, j) at i·γ' + j - 1 among them
            per_node = getattr(streams.adapters, "inserted", None)
            if per_node is None:
                raise TypeError("the stream oracle needs OracleStreams adapters (they count the streams inserted)")
            stream[..., -streams.count:] = torch.arange(streams.count, device=out.device) % per_node + 1
        self._streams = stream.reshape(-1)
        return out

    def scheduled(self, wanted: torch.Tensor) -> torch.Tensor:
        """The token the draft's main stream proposes at positions ``wanted``: the reference's, or another one
        where the schedule (or the reference's end) says miss."""
        ref = self.reference
        token = ref[wanted.clamp(max=len(ref) - 1)]
        miss = wanted >= len(ref)
        if self.accept is not None:
            miss |= (wanted - self.prompt_len) % (self.accept + 1) == self.accept
        return torch.where(miss, (token + 1) % self.config.vocab_size, token)

    def logits(self, hidden: torch.Tensor, head: object = None) -> torch.Tensor:
        index = hidden[..., 0].float().round().long() + 256 * hidden[..., 1].float().round().long()
        stream = self._streams[index]
        wanted = self._positions[index] + 1 + stream  # a main row predicts the next position, stream j j further
        token = self.scheduled(wanted)
        vocab = self.config.vocab_size
        logits = torch.full((*token.shape, vocab), -30.0, device=hidden.device)
        if self.stream_hit is None:
            return logits.scatter_(-1, token.unsqueeze(-1), 30.0)
        u = keyed_uniforms(0, (wanted * 64 + stream).reshape(-1), 1, device=hidden.device).view(wanted.shape)
        right = (stream == 0) | (u < self.stream_hit)
        top = torch.where(right, token, (token + 2) % vocab)
        logits.scatter_(-1, token.unsqueeze(-1), -60.0)  # a wrong guess ranks its position's token last
        return logits.scatter_(-1, top.unsqueeze(-1), 30.0)


class OracleStreams(StreamAdapters):
    """Stream adapters that count the streams each pass inserts beside a node (a busy batch inserts fewer), so
    :class:`OracleDraft` can tell which stream a row is."""

    inserted: int | None = None

    def insert(self, main: torch.Tensor, streams: int | None = None) -> torch.Tensor:
        self.inserted = streams or self.config.streams
        return super().insert(main, streams)


class ExitOracle(Transformer):
    """The target with an early exit that holds the correction at a chosen rate: random weights' exit never does,
    so Mirror-SD never hits. Its layers and final logits run for real, so every answer is still the target's; only
    the logits Mirror-SD's early exit reads off the lower layers' hidden states are made up. Row j's top-κ holds the
    target's own next token (the greedy reference) with probability ``hit_rate``, at a random rank, and otherwise κ
    other tokens (never the oracle draft's wrong guess, ``token + 1``), keyed by position: every root is rolled out
    as with real weights."""

    reference: torch.Tensor  # prompt + the target's greedy answer, on the target's device
    hit_rate: float
    kappa: int
    _exit: torch.Tensor | None

    @classmethod
    def wrap(cls, target: Transformer, prompt: list[int], reference: list[int], hit_rate: float,
             kappa: int) -> ExitOracle:
        oracle = cls.__new__(cls)
        oracle.__dict__.update(target.__dict__)  # shares the target's modules, buffers and config
        oracle.reference = torch.tensor([*prompt, *reference], device=target.device)
        oracle.hit_rate, oracle.kappa, oracle._exit, oracle._positions = hit_rate, kappa, None, None
        return oracle

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, cache: Any = None, mask: Any = None,
                   start: int = 0, end: int | None = None, streams: Any = None, **kwargs: Any) -> torch.Tensor:
        out = super().run_layers(hidden, positions, cache, mask, start, end, streams, **kwargs)
        if start == 0 and end is not None and end < self.config.n_layers:  # the lower half: the exit reads it
            self._exit, self._positions = out, positions.expand(out.shape[:-1])
        return out

    def logits(self, hidden: torch.Tensor, head: Any = None) -> torch.Tensor:
        if hidden is not self._exit:
            return super().logits(hidden, head)
        wanted = self._positions + 1  # each row predicts the next position's token
        token = self.reference[wanted.clamp(max=len(self.reference) - 1)]
        u = keyed_uniforms(0, wanted.reshape(-1), 2, device=hidden.device).view(*wanted.shape, 2)
        hit = u[..., 0] < self.hit_rate
        rank = torch.where(hit, (u[..., 1] * self.kappa).long().clamp(max=self.kappa - 1), self.kappa)
        vocab = self.config.vocab_size
        # κ + 1 candidates, best first; the reference's token at ``rank`` (past the top κ on a miss)
        slots = torch.arange(self.kappa + 1, device=hidden.device)
        others = (token.unsqueeze(-1) + 2 + slots - (slots > rank.unsqueeze(-1)).long()) % vocab
        ids = torch.where(slots == rank.unsqueeze(-1), token.unsqueeze(-1), others)
        logits = torch.full((*token.shape, vocab), -30.0, device=hidden.device)
        return logits.scatter_(-1, ids, 20.0 - slots.float().expand_as(ids))


@dataclass
class MethodRun:
    target: str
    method: str
    label: str
    tok_s: float
    mean_accepted: float
    equal_to_ar: bool
    divergence: dict[str, Any] | None
    mirror: dict[str, Any] | None = None
    failed: str | None = None  # the error, where the method could not run on this machine
    stats: dict[str, Any] | None = None  # the method's own statistics (``ss``: its passes replayed as graphs)



def timed_generate(target: Transformer, prompt: list[int], max_new: int, **kwargs: Any) -> tuple[Any, float]:
    """A greedy generation and its wall seconds, synchronised (CUDA runs asynchronously)."""
    synchronize(target.device)
    start = time.perf_counter()
    out = generate(target, prompt, max_new_tokens=max_new, temperature=0.0, **kwargs)
    synchronize(target.device)
    return out, time.perf_counter() - start


def divergence(target: Transformer, prompt: list[int], got: list[int], want: list[int]) -> dict[str, Any] | None:
    pos = metrics.first_divergence(want, got)
    if pos is None:
        return None
    if pos >= min(len(got), len(want)):
        return {"position": pos, "verdict": "length differs"}
    with torch.inference_mode():
        ids = torch.tensor([prompt + want[:pos]], device=target.device)
        logits = target(ids, cache=target.new_cache(capacity=ids.shape[1] + 1), last=1)[0, -1].float()
    gap = float(logits[want[pos]] - logits[got[pos]])
    verdict = "float near-tie" if abs(gap) < NEAR_TIE.get(target.dtype, 1e-3) else "mismatch"
    # The spacing of the model dtype's numbers at this logit: a gap of an ulp or two is the rounding of a GEMM
    # that orders its sums differently for k rows than for one (reported, not allowed).
    ulp = float(torch.finfo(target.dtype).eps) * 2.0 ** math.floor(math.log2(max(abs(float(logits[want[pos]])), 1e-30)))
    return {"position": pos, "ar_token": want[pos], "method_token": got[pos], "logit_gap": gap,
            "logit": float(logits[want[pos]]), "dtype_ulp_at_logit": ulp, "verdict": verdict}


def _methods(device: torch.device, draft: Transformer, streams: Any,
             host_draft: Transformer | None = None) -> list[tuple[str, str, dict[str, Any]]]:
    """(method, label, options) of every method on random weights; ``host_draft``: the draft's shape on the CPU, for
    Mirror-SD's ``devices`` backend (the target here, the draft on the host: only token ids cross)."""
    overlap = "cuda-streams" if device.type == "cuda" else "threads"
    runs = [("sd", "sd", {"draft": draft}), ("suffix", "suffix", {}),
            ("mirror", "mirror serial", {"draft": draft, "backend": "serial", "budget": 2}),  # (0 roots unforced)
            ("ss", "ss (untrained streams)", {"streams": streams})]
    if device.type == "cuda" or torch.get_num_threads() > 1:
        runs.append(("mirror", f"mirror {overlap}", {"draft": draft, "backend": overlap}))
    if host_draft is not None:
        # (γ = 2 and one root: a CPU's draft forward costs tens of ms, so a short step keeps the run short)
        runs.append(("mirror", "mirror devices (draft on the CPU)",
                     {"draft": host_draft, "backend": "devices", "gamma": 2, "budget": 1}))
    return runs


#: `mirrorsd train-streams`'s recipe of the shipped 1.5B adapter: γ = 3 streams, N_s = 4 layers, rank 16, a
#: 32k-id training head, 256-token chunks.
TRAIN_RECIPE = {"streams": 3, "layers": 4, "rank": 16, "vocab": 32768, "seq_len": 256}
#: The data budget `docs/speculative_streaming.md` estimates for stream-1 top-1 ≈ 0.6 on the 1.5B (~50× the
#: shipped adapter's 81k chat tokens), for the time-to-train column.
CEILING_TOKENS = 4_000_000
DRY_TRAIN_RECIPE = {"layers": 2, "rank": 4, "vocab": 256, "seq_len": 32}


def train_costs(target: Transformer, *, steps: int = 8, chunks: int = 4, recipe: dict[str, int] | None = None
                ) -> dict[str, Any]:
    """Speculative Streaming training on this device, through `train-streams`' own functions: ms to cache one
    chunk's frozen states (:func:`~mirrorsd.train_streams.freeze`) and ms per optimizer step
    (:func:`~mirrorsd.train_streams.train_step`), median over ``steps`` after two warm-up steps."""
    from ..train_streams import Cached, freeze, train_step
    from ..training import Chunk, TrainHead

    recipe = TRAIN_RECIPE | (recipe or {})
    cfg, seq_len = target.config, recipe["seq_len"]
    generator = torch.Generator().manual_seed(0)
    windows = [Chunk(torch.randint(0, cfg.vocab_size, (seq_len,), generator=generator), 1) for _ in range(chunks)]
    target.requires_grad_(False)
    adapters = StreamAdapters(target, StreamConfig(streams=recipe["streams"], layers=recipe["layers"],
                                                   rank=recipe["rank"], alpha=2 * recipe["rank"],
                                                   hidden_size=cfg.hidden_size, n_layers=cfg.n_layers,
                                                   vocab_size=cfg.vocab_size))
    cache_ms, items = [], []
    for chunk in windows:
        synchronize(target.device)
        start = time.perf_counter()
        frozen = freeze(target, adapters.first_layer, chunk)
        synchronize(target.device)
        cache_ms.append((time.perf_counter() - start) * 1e3)
        items.append(Cached(frozen["hidden"], frozen["keys"], frozen["values"], frozen["labels"].long(), 1))
    head = TrainHead(target, torch.arange(min(recipe["vocab"], cfg.vocab_size)))
    optimizer = torch.optim.AdamW(adapters.trainable(), lr=1e-4)
    step_ms = []
    for step in range(steps + 2):  # two warm-up steps
        synchronize(target.device)
        start = time.perf_counter()
        train_step(target, adapters, items[step % chunks], head, optimizer)
        synchronize(target.device)
        if step >= 2:
            step_ms.append((time.perf_counter() - start) * 1e3)
    step = statistics.median(step_ms)
    tokens_s = (seq_len - 1) / step * 1e3
    return {**recipe, "dtype": str(target.dtype).removeprefix("torch."), "steps_timed": steps,
            "cache_ms_per_chunk": statistics.median(cache_ms[1:] or cache_ms), "step_ms": step,
            "train_tokens_per_s": tokens_s, "ceiling_tokens": CEILING_TOKENS,
            "minutes_per_epoch_of_ceiling": CEILING_TOKENS / tokens_s / 60}


#: Context of the long-context forward row (the goal: k=1 there ≤ 1.3× its 128-token time).
LONG_CONTEXT = 4000


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy, read and write counted (median of 5): the rate a forward
    that only reads its weights could reach at best."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times)


def weight_bytes(model: Transformer) -> int:
    """What a forward must read: every layer's weights and the LM head (the embedding reads a row per token)."""
    layers = sum(p.numel() * p.element_size() for p in model.layers.parameters())
    head = model.lm_head.weight
    return layers + head.numel() * head.element_size()


@torch.inference_mode()
def kernels_per_layer(model: Transformer, context: int = 128) -> float | None:
    """Kernels (and copies) a one-token forward's layer launches, counted by the profiler on the path the graphs
    capture: (all layers - one layer) / (layers - 1). None off CUDA."""
    if model.device.type != "cuda" or model.config.n_layers < 2:
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cache = model.new_cache(capacity=context + 2)
    model(torch.zeros(1, context, dtype=torch.long, device=model.device), cache=cache, last=1)
    hidden = model.embed(torch.zeros(1, 1, dtype=torch.long, device=model.device))
    positions = torch.full((1, 1), context, device=model.device)
    counts = []
    for end in (1, model.config.n_layers):
        with cuda_graphs(False), profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.run_layers(hidden, positions, cache, end=end)
            synchronize(model.device)
        cache.truncate(context)
        counts.append(sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA))
    return (counts[1] - counts[0]) / (model.config.n_layers - 1)


@torch.inference_mode()
def kernel_times(model: Transformer, context: int = 128, rounds: int = 5, top: int = 10) -> dict[str, Any] | None:
    """Where a one-token forward's device time goes, as ``ar`` runs it (graphs on): each kernel name's launches
    and microseconds per forward (the ``top`` dearest), their sum, and the forward's wall time. A sum near the
    wall time means the device is busy; far below, the host is what the forward waits for. None off CUDA."""
    if model.device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cache = model.new_cache(capacity=context + 2)
    model(torch.zeros(1, context, dtype=torch.long, device=model.device), cache=cache, last=1)
    token = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    for _ in range(3):  # a shape is captured on its third sight
        model(token, cache=cache)
        cache.truncate(context)
    synchronize(model.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(rounds):
            model(token, cache=cache)
            cache.truncate(context)
        synchronize(model.device)
        wall_ms = (time.perf_counter() - start) * 1e3 / rounds
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            kernels.setdefault(e.name[:70], []).append(e.device_time)
    rows = sorted(((name, len(t) / rounds, sum(t) / rounds) for name, t in kernels.items()), key=lambda r: -r[2])
    return {"wall_ms": wall_ms, "kernel_us": sum(r[2] for r in rows), "launches": sum(r[1] for r in rows),
            "top": [{"name": n, "launches": c, "us": us} for n, c, us in rows[:top]]}


#: Tokens over which the bench counts host syncs: several of ``sd``'s γ = 20 windows. Over 16, every window was
#: cut to the room left, a shape new to the request each step, which runs eagerly (19.8 syncs a step on an H200).
SYNC_TOKENS = 96


def host_syncs_per_step(target: Transformer, prompt: list[int], tokens: int = 16, warm: bool = False,
                        **options: Any) -> float | None:
    """Synchronising CUDA calls (PyTorch's sync debug mode) and event waits (``ar``'s read of a token it ran ahead
    of, which the debug mode does not see) per decoding step, over a whole ``generate`` (an ``ar`` step is a
    token). ``warm``: after one uncounted ``generate`` of the same request, so the counted one replays the graphs a
    server's later requests replay (captured on a shape's second sight)."""
    if target.device.type != "cuda":
        return None
    import warnings
    from unittest import mock

    request = {"max_new_tokens": tokens, "temperature": 0.0, **options}
    if warm:
        generate(target, prompt, **request)

    waits = mock.patch.object(torch.cuda.Event, "synchronize", autospec=True,
                              side_effect=torch.cuda.Event.synchronize)
    with warnings.catch_warnings(record=True) as caught, waits as waited:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = generate(target, prompt, **request)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return (sum("synchroniz" in str(w.message) for w in caught) + waited.call_count) / result.stats.steps


def hf_peer(hf: torch.nn.Module, prompt: list[int], max_new: int) -> dict[str, Any]:
    """HF transformers' own ``generate`` on the same weights, greedy, ``max_new`` tokens exactly: eager, and with
    its static cache and ``torch.compile`` (two untimed generations compile it first). A failure is reported, not
    raised."""
    device = next(hf.parameters()).device
    ids = torch.tensor([prompt], device=device)
    result: dict[str, Any] = {}
    for label, options, warm in (("eager", {}, 1), ("static cache + compile", {"cache_implementation": "static"}, 2)):
        try:
            for _ in range(warm + 1):
                synchronize(device)
                start = time.perf_counter()
                hf.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, **options)
                synchronize(device)
            result[label] = max_new / (time.perf_counter() - start)
        except Exception as error:  # noqa: BLE001 - a peer that cannot run is a row of the report, not a crash
            result[label] = f"failed: {type(error).__name__}: {str(error)[:200]}"
    return result


def step_costs(name: str, target: Transformer, draft: Transformer, hf: torch.nn.Module | None, prompt: list[int],
               bandwidth: float, ar_tokens: int, say: Any) -> dict[str, Any]:
    """A forward's cost against the bandwidth floor (the target's, the draft's, at a long context), kernels per
    layer, host syncs per step (``ar``'s, ``sd``'s at a fixed window and under its default confidence rule, and
    Mirror-SD's with paper roots, serial), and,
    with ``hf``, HF transformers' ``generate`` next to our ``ar`` at ``ar_tokens`` tokens."""
    target_ms = forward_costs(target, (1,), context=len(prompt), rounds=5)[1]
    draft_ms = forward_costs(draft, (1,), context=len(prompt), rounds=5)[1]
    long_ms = forward_costs(target, (1,), context=LONG_CONTEXT, rounds=3)[1]
    floor = {m: weight_bytes(model) / bandwidth * 1e3 for m, model in (("target", target), ("draft", draft))}
    row = {"target": name, "k1_ms": target_ms, "floor_ms": floor["target"], "draft_k1_ms": draft_ms,
           "draft_floor_ms": floor["draft"], "long_context": LONG_CONTEXT, "long_k1_ms": long_ms,
           "kernels_per_layer": kernels_per_layer(target), "draft_kernels_per_layer": kernels_per_layer(draft),
           "host_syncs_per_step": host_syncs_per_step(target, prompt, SYNC_TOKENS, warm=True),
           "kernel_times": kernel_times(target, len(prompt)), "draft_kernel_times": kernel_times(draft, len(prompt))}
    # the one-read steps of `sd` (a fixed window, and at its default confidence rule, decided on the device) and
    # Mirror-SD, each counted apart: a path that fails on this machine is a row's note
    for key, options in (("sd", {"method": "sd", "suffix_match": 0, "confidence": 0.0}),
                         ("sd_confident", {"method": "sd", "suffix_match": 0}),
                         ("mirror", {"method": "mirror", "backend": "serial", "roots": "paper", "confidence": 0.0})):
        try:
            row[f"{key}_host_syncs_per_step"] = host_syncs_per_step(target, prompt, SYNC_TOKENS, warm=True,
                                                                    draft=draft, **options)
        except Exception as error:  # noqa: BLE001 - reported, and the rest of the run goes on
            row[f"{key}_host_syncs_per_step"] = None
            row.setdefault("failed", {})[f"{key}_host_syncs_per_step"] = f"{type(error).__name__}: {str(error)[:200]}"
    if hf is not None:
        say("  HF transformers' generate (eager, static cache + compile)…", flush=True)
        ours, secs = timed_generate(target, prompt, ar_tokens, method="ar")
        row["peer"] = {"tokens": ar_tokens, "ar_tok_s": len(ours.token_ids) / secs,
                       **hf_peer(hf, prompt, ar_tokens)}
    return row


#: The CUDA tests' share of a lease: the whole validation must fit ~6 minutes, so a test that hangs (a stream waiting
#: on an event never recorded, a deadlock between the draft's thread and the target's) must not take the rest.
CUDA_TESTS_TIMEOUT_S = 240


def run_cuda_tests(repo: Path, select: str | None = None, timeout: float = CUDA_TESTS_TIMEOUT_S) -> dict[str, Any]:
    """``tests/test_cuda.py`` in a child process (a CUDA error there cannot end this run); ``select``: one ``-k``.
    ``passed``: the names of the tests that passed; ``failed``: each failed test's name and pytest's one-line reason
    (a lease's report is all a later session sees of the run); ``slowest``: pytest's slowest durations. Past
    ``timeout`` seconds the child is killed and what passed until then is kept (``timed_out``)."""
    tests = repo / "tests" / "test_cuda.py"
    if not tests.is_file():
        return {"ran": False, "why": f"{tests} not found (run from the repository root)", "passed": []}
    command = [sys.executable, "-m", "pytest", "-v", "-rA", "--tb=short", "--durations=8", "-p", "no:cacheprovider",
               str(tests),
               *(("-k", select) if select else ())]
    try:
        proc = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=timeout)
        text, returncode, timed_out = proc.stdout + proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as expired:
        text = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                       for part in (expired.stdout, expired.stderr))
        returncode, timed_out = None, True
    lines = text.strip().splitlines()
    # -v prints "tests/test_cuda.py::name PASSED [ 5%]" as each test ends: a killed run keeps those
    passed = sorted({line.split("::", 1)[1].split()[0] for line in lines
                     if "::" in line and (line.startswith("PASSED ") or " PASSED" in line)})
    # -rA's summary: "FAILED tests/test_cuda.py::name - AssertionError: ..." (ERROR for a failed setup)
    failed = {line.split("::", 1)[1].split(" - ", 1)[0].strip(): line.split(" - ", 1)[1][:300] if " - " in line else ""
              for line in lines if line.startswith(("FAILED ", "ERROR ")) and "::" in line}
    slowest = [line.strip() for line in lines if line.strip()[:1].isdigit() and "s call " in line]
    ran = {"ran": True, "returncode": returncode, "summary": (lines[-1:] or [""])[0], "passed": passed,
           "failed": failed, "slowest": slowest}
    if timed_out:
        ran.update(timed_out=True, summary=f"killed after {timeout:.0f} s; {len(passed)} passed before that")
    return ran


#: Seconds a timed-out batch's requests get to stop after their current step.
STOP_WAIT_S = 30.0
BATCH_TIMEOUT_S = 90.0  # a batched run's limit in the bench (seconds at most on a working GPU)
#: Concurrent requests of the continuous-batching rows (issue 57: the sweep on the 1.5B shape).
BATCH_LEVELS = (1, 4, 16)
#: The speculating method of those rows, under each speculation rule: the only one that drafts right on random
#: weights (their greedy answers fall into loops a suffix match copies), so the goodput rule has windows to keep or cut.
BATCH_SPECULATION = "suffix"


def run_batched(target: Transformer, requests: list[dict[str, Any]], max_new: int, timeout_s: float = 300.0,
                speculation: str = "fixed") -> tuple[list[list[int]], float, list[Any]]:
    """Each request (``generate``'s keywords, ``prompt`` among them) on a thread of its own through one
    :class:`~mirrorsd.batching.Batcher` under ``speculation``, as ``mirrorsd serve`` runs them: their tokens, the
    wall seconds, and the batcher's step records. Each request's suffix index is its own (no request copies
    another's answer, nor one of an earlier batch's). A request's error is raised here, and so is a batch still
    running after ``timeout_s`` (a hung batch would otherwise spend a whole GPU lease). Timed out, the requests are
    stopped at their next token, so the figures after this one do not run beside them."""
    import threading

    from ..batching import Batcher
    from ..decoding.suffix_index import isolated_shared_indexes

    batcher = Batcher(speculation=speculation)
    out: list[Any] = [None] * len(requests)
    stop = threading.Event()

    def member(i: int, options: dict[str, Any]) -> None:
        try:
            with batcher.member(), isolated_shared_indexes():
                s = stream(target, max_new_tokens=max_new, **options)
                deltas = s.deltas()
                for _ in deltas:
                    if stop.is_set():
                        deltas.close()
                        out[i] = TimeoutError("stopped: the batch timed out")
                        return
                out[i] = s.result.token_ids
        except BaseException as error:  # noqa: BLE001 - raised on the caller's thread below
            out[i] = error

    threads = [threading.Thread(target=member, args=(i, r), daemon=True) for i, r in enumerate(requests)]
    synchronize(target.device)
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, start + timeout_s - time.perf_counter()))
    if any(thread.is_alive() for thread in threads):
        running = sum(t.is_alive() for t in threads)
        stop.set()
        deadline = time.perf_counter() + STOP_WAIT_S
        for thread in threads:  # (each stops after its current step; one wait for all, not one each)
            thread.join(max(0.0, deadline - time.perf_counter()))
        left = sum(t.is_alive() for t in threads)
        raise TimeoutError(f"{running} of {len(threads)} batched requests still running after {timeout_s:.0f} s; "
                           + (f"{left} did not stop within {STOP_WAIT_S:.0f} s more (they run on beside what "
                              "follows)" if left else "stopped"))
    synchronize(target.device)
    wall = time.perf_counter() - start
    for got in out:
        if isinstance(got, BaseException):
            raise got
    return out, wall, list(batcher.steps)


def batched_runs(target: Transformer, prompt: list[int], max_new: int, levels: tuple[int, ...] = BATCH_LEVELS
                 ) -> list[dict[str, Any]]:
    """At each concurrency in ``levels`` (request ``i`` on the prompt rotated by ``i``): ``ar`` one request after
    another and all at once, then :data:`BATCH_SPECULATION` all at once under each speculation rule (``fixed``: its
    own windows; ``goodput``: the rule that cuts them where rows cost, which on a GPU's flat row curve should keep
    them). Aggregate tok/s, the draft rows per step, and whether every answer is its alone ``ar`` answer."""
    from ..batching import SPECULATION

    rows = []
    for level in levels:
        requests = [{"prompt": prompt[i:] + prompt[:i], "method": "ar", "temperature": 0.0} for i in range(level)]
        alone, alone_s = [], 0.0
        for r in requests:
            res, secs = timed_generate(target, r["prompt"], max_new, method="ar")
            alone.append(res.token_ids)
            alone_s += secs
        got, wall, steps = run_batched(target, requests, max_new, timeout_s=BATCH_TIMEOUT_S)
        tokens = sum(len(a) for a in alone)
        row = {"requests": level, "alone_tok_s": tokens / alone_s, "batched_tok_s": sum(map(len, got)) / wall,
               "most_windows_in_a_step": max((s.windows + s.prompts for s in steps), default=0),
               "equal_alone": got == alone}
        speculating = [{**r, "method": BATCH_SPECULATION} for r in requests]
        for rule in SPECULATION:
            got, wall, steps = run_batched(target, speculating, max_new, timeout_s=BATCH_TIMEOUT_S, speculation=rule)
            windows = [s for s in steps if s.windows]
            row[f"{BATCH_SPECULATION}_{rule}"] = {
                "tok_s": sum(map(len, got)) / wall, "equal_alone": got == alone,
                "draft_rows_per_step": sum(s.speculation_rows for s in windows) / max(len(windows), 1)}
        rows.append(row)
    return rows


def run(out: Path, *, device: str | None = None, max_new: int | None = None, prompt_len: int = 128,
        accepts: tuple[int, ...] = (1, 3, 5), gamma: int = 7, targets: tuple[str, ...] = TARGETS,
        ks: tuple[int, ...] = (1, 2, 4, 8, 16, 32), tests: bool = True, repo: Path | None = None,
        progress: bool = True, dtype: torch.dtype | None = None, peer: bool = True,
        peer_tokens: int = 128) -> dict[str, Any]:
    """Run the whole validation and write ``report.json``, ``report.md`` and Mirror-SD traces into ``out``.
    ``dtype``: the models' (default bf16 on CUDA; fp32 makes GEMMs nearly batch-invariant, for a strict
    lossless check). ``peer``: HF transformers' ``generate`` on the first target's weights, at ``peer_tokens``."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dry = dev.type != "cuda"
    dtype = dtype or (torch.float32 if dry else torch.bfloat16)
    shapes = DRY_SHAPES if dry else REAL_SHAPES
    max_new = max_new or (16 if dry else GPU_MAX_NEW)
    say = print if progress else (lambda *a, **k: None)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"machine": machine(), "device": str(dev), "dry_run": dry, "dtype": str(dtype),
                              "shapes": {k: asdict(v) for k, v in shapes.items()}, "max_new_tokens": max_new,
                              "prompt_tokens": prompt_len, "gamma": gamma}
    if tests:
        say("CUDA-gated tests…", flush=True)
        report["cuda_tests"] = run_cuda_tests(repo or Path.cwd())
    overlaps: tuple[str, ...] = ()
    if not dry:  # Mirror-SD's other ways to overlap: each measured only where its own test passed, in a child first
        ran = report.get("cuda_tests") or run_cuda_tests(repo or Path.cwd(), " or ".join(
            select for _, select in OVERLAPS.values()))
        report["overlap_tests"] = {name: any(select in test for test in ran.get("passed", []))
                                   for name, (_, select) in OVERLAPS.items()}
        overlaps = tuple(name for name, passed in report["overlap_tests"].items() if passed)
    report["forward_ms"], report["forward_ms_eager"], report["methods"], report["forced"], report["train"] = \
        {}, {}, [], [], {}
    report["batched"] = {}
    report["costs"], report["copy_bytes_per_s"] = [], copy_bandwidth(dev, 1 << (20 if dry else 30))
    for i, name in enumerate(targets):
        say(f"{name}-shaped target: forward curve…", flush=True)
        hf = random_hf(shapes[name], dev, dtype, seed=1 + i)
        target = Transformer.from_hf(hf, linear="dense")
        if not (peer and i == 0 and name not in LARGE_TARGETS):
            hf = None  # (only the peer reads it: a 32B's HF tensors and its merged ones would not fit together)
        draft = random_model(replace(shapes[DRAFT], vocab=shapes[name].vocab), dev, dtype, seed=0)
        report["forward_ms"][name] = forward_costs(target, ks, context=prompt_len, rounds=5)
        with cuda_graphs(False):  # the host-bound path, for comparison
            report["forward_ms_eager"][name] = forward_costs(target, ks, context=prompt_len, rounds=5)
        say("  costs: floor, draft, long context, kernels, syncs…", flush=True)
        prompt = torch.randint(0, shapes[name].vocab, (prompt_len,), generator=torch.Generator().manual_seed(i))
        prompt = prompt.tolist()
        report["costs"].append(step_costs(name, target, draft, hf, prompt, report["copy_bytes_per_s"],
                                          16 if dry else peer_tokens, say))
        del hf
        _write(out, report)
        say("  train-streams step…", flush=True)
        report["train"][name] = train_costs(target, recipe=DRY_TRAIN_RECIPE if dry else None)
        _write(out, report)
        ar, ar_s = timed_generate(target, prompt, max_new, method="ar")
        reference = ar.token_ids
        report["methods"].append(asdict(MethodRun(name, "ar", "ar", len(reference) / ar_s, 1.0, True, None)))
        with cuda_graphs(False):
            eager, eager_s = timed_generate(target, prompt, max_new, method="ar")
        report["methods"].append(asdict(MethodRun(
            name, "ar", "ar (eager: no CUDA graphs)", len(eager.token_ids) / eager_s, 1.0,
            eager.token_ids == reference, divergence(target, prompt, eager.token_ids, reference))))
        cfg = target.config
        streams = StreamAdapters(target, StreamConfig(streams=3, layers=2, hidden_size=cfg.hidden_size,
                                                      n_layers=cfg.n_layers, vocab_size=cfg.vocab_size))
        streams = streams.to(device=dev, dtype=dtype).eval()
        # the devices backend once, with the draft on the host (issue 62: it keeps working, measured once on the GPU)
        host_draft = random_model(replace(shapes[DRAFT], vocab=shapes[name].vocab), torch.device("cpu"),
                                  torch.float32, seed=0) if dev.type == "cuda" and i == 0 else None
        for method, label, options in _methods(dev, draft, streams, host_draft):
            say(f"  {label}…", flush=True)
            try:
                res, secs = timed_generate(target, prompt, max_new, method=method, **options)
            except Exception as error:  # noqa: BLE001 - a method that fails here is a row; the others still run
                report["methods"].append(asdict(MethodRun(name, method, label, 0.0, 0.0, False, None,
                                                          failed=f"{type(error).__name__}: {str(error)[:300]}")))
                continue
            report["methods"].append(asdict(MethodRun(
                name, method, label, len(res.token_ids) / secs, res.stats.mean_accepted_length,
                res.token_ids == reference, divergence(target, prompt, res.token_ids, reference),
                _mirror(res, out / f"trace_{name}_{label.replace(' ', '_')}.json"),
                stats=res.stats.extra[method].to_dict() if method in res.stats.extra and method != "mirror" else None)))
            _write(out, report)
        report["forced"].extend(_forced(name, target, draft, prompt, reference, accepts, gamma, dev, max_new, out,
                                        say, overlaps))
        _write(out, report)
        if i == 0:
            batch_on = (name, target, prompt)  # (batched last: a failure there, on a path new to GPUs, loses only it)
        del target, draft
    if targets:
        name, target, prompt = batch_on
        say(f"{name}-shaped target: continuous batching (ar, {BATCH_SPECULATION})…", flush=True)
        try:
            report["batched"][name] = batched_runs(target, prompt, max_new, (1, 2) if dry else BATCH_LEVELS)
        except Exception as error:  # noqa: BLE001 - reported, as a method's failure is
            report["batched"][name] = f"failed: {type(error).__name__}: {str(error)[:300]}"
        _write(out, report)
    return report


def _write(out: Path, report: dict[str, Any]) -> None:
    """(Re)write the report after each stage: a run stopped at a time limit keeps what it measured."""
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report))


def _mirror(result: Any, trace: Path) -> dict[str, Any] | None:
    stats = result.stats.extra.get("mirror")
    if stats is None:
        return None
    info = stats.to_dict()
    if result.stats.spans:
        write_chrome_trace(result.stats.spans, trace, metadata={"method": "mirror", "backend": info["backend"]})
        info["trace"] = trace.name
    return info


#: The exit oracle's hit rate in every forced run (the paper's 1 − fallback at κ = 8 is 0.74–0.83), its κ, and the
#: further rates at A = 3, where Mirror-SD runs again (vanilla SD reads no exit) so the law's shape in the rate shows.
EXIT_HIT, EXIT_KAPPA, EXIT_HITS_AT_3 = 0.75, 8, (0.5, 1.0)
#: The SS draft's stream-1 acceptance at A = 3 (issue 62: the stream oracle at 0.5), where SD and Mirror-SD also run
#: with a Speculative Streaming draft: the Mirror-SD paper's Fig. 4, {SD, Mirror-SD} × {plain, SS draft}.
STREAM_HIT, STREAM_ACCEPT = 0.5, 3
#: Mirror-SD's other ways to overlap on ``cuda-streams`` than the default (a worker thread issues the rollouts, both
#: sides eager while they overlap), each run at A = 3 where its CUDA test (the ``-k`` here) passed in a child run first:
#: ``graphs``, the worker with CUDA graphs on; ``inline``, no worker, the target's thread issuing both streams;
#: ``paper``, that with every exit candidate a root: the exit's top-κ, the rollouts and the branch pick stay on the
#: device, and a step reads the host once (issue 62, item 1).
OVERLAPS = {"graphs": ({"overlap_graphs": "on"}, "overlap_graphs"),
            "inline": ({"draft_issue": "inline"}, "streams_issued_inline"),  # (not paper_roots_issued_inline's)
            "paper": ({"draft_issue": "inline", "roots": "paper"}, "paper_roots_issued_inline")}


def oracle_streams(draft: Transformer) -> OracleStreams:
    """Untrained stream adapters of the shipped draft adapter's shape (3 streams in the top 4 layers) on ``draft``,
    in its dtype: their cost is real, their guesses are :class:`OracleDraft`'s."""
    cfg = draft.config
    streams = OracleStreams(draft, StreamConfig(streams=3, layers=min(4, cfg.n_layers - 1), hidden_size=cfg.hidden_size,
                                                n_layers=cfg.n_layers, vocab_size=cfg.vocab_size))
    return streams.to(device=draft.device, dtype=draft.dtype).eval()


def draft_eta(result: Any) -> float | None:
    """Draft tokens per draft forward over a generation (η̄ for an SS draft, ~1 for a plain one)."""
    forwards = result.stats.draft_forwards
    return sum(result.stats.drafted) / forwards if forwards else None


def _forced(name: str, target: Transformer, draft: Transformer, prompt: list[int], reference: list[int],
            accepts: tuple[int, ...], gamma: int, dev: torch.device, max_new: int, out: Path,
            say: Any, overlaps: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """SD and Mirror-SD at forced acceptance lengths (the oracle draft's schedule), same window γ, Mirror-SD's
    early exit holding the correction at forced rates (the exit oracle); at A = :data:`STREAM_ACCEPT` both also with
    an SS draft whose streams guess right at :data:`STREAM_HIT` (a failure there is a row, not the end of the run);
    ``overlaps``: at A = 3 also Mirror-SD's other ways to overlap (:data:`OVERLAPS`)."""
    backend = "cuda-streams" if dev.type == "cuda" else "serial"
    roots = {"budget": 2} if backend == "serial" else {}  # (serial rolls out no root unless told)
    rows = []
    for accept in (*accepts, None):
        label = "all" if accept is None else str(accept)
        for kind in ("plain", "ss") if accept == STREAM_ACCEPT else ("plain",):
            try:
                rows += _forced_runs(name, target, draft, prompt, reference, accept, kind, gamma, backend, roots,
                                     max_new, out, say, overlaps)
            except Exception as error:  # noqa: BLE001 - the SS draft has not run on a GPU yet: report, go on
                if kind == "plain":
                    raise
                rows.append({"target": name, "accept": label, "draft": kind, "exit_hit_rate": EXIT_HIT,
                             "overlap": "thread", "failed": f"{type(error).__name__}: {str(error)[:300]}"})
    return rows


def _forced_runs(name: str, target: Transformer, draft: Transformer, prompt: list[int], reference: list[int],
                 accept: int | None, kind: str, gamma: int, backend: str, roots: dict[str, Any], max_new: int,
                 out: Path, say: Any, overlaps: tuple[str, ...]) -> list[dict[str, Any]]:
    """One forced acceptance and draft kind: SD once, Mirror-SD at each exit hit rate."""
    ss = kind == "ss"
    oracle = OracleDraft.wrap(draft, prompt, reference, accept, STREAM_HIT if ss else None)
    label = "all" if accept is None else str(accept)
    say(f"  forced acceptance {label}{', SS draft' if ss else ''}…", flush=True)
    # draft_vocab=0: a reduced-vocabulary head would read the draft's states without the oracle's logits (an SS
    # draft's main rows read it too).
    drafting: dict[str, Any] = {"draft_vocab": 0, **({"draft_streams": oracle_streams(draft)} if ss else {})}
    sd, sd_s = timed_generate(target, prompt, max_new, method="sd", draft=oracle, gamma=gamma, confidence=0.0,
                              suffix_match=0, **drafting)
    sd_row = {"tok_s": len(sd.token_ids) / sd_s, "mean_accepted": sd.stats.mean_accepted_length,
              "equal_to_ar": sd.token_ids == reference, "draft_eta": draft_eta(sd)}
    runs = [(EXIT_HIT, "thread")]
    if accept == 3 and not ss:
        runs += [(hit, "thread") for hit in EXIT_HITS_AT_3] + [(EXIT_HIT, overlap) for overlap in overlaps]
    rows = []
    for hit, overlap in runs:
        extra = OVERLAPS[overlap][0] if overlap in OVERLAPS else {}
        options = extra if "roots" in extra else {**roots, **extra}  # (a root mode of its own takes no budget)
        suffix = ("" if overlap == "thread" else f"_{overlap}") + ("_ss" if ss else "")
        mirror_row = _mirror_run(target, oracle, prompt, reference, hit, gamma, backend, max_new, drafting, options,
                                 out / f"trace_{name}_forced_{label}_hit{hit:g}{suffix}.json")
        rows.append({"target": name, "accept": label, "draft": kind, "exit_hit_rate": hit, "overlap": overlap,
                     "sd": sd_row, "mirror": mirror_row, "mirror_over_sd": mirror_row["tok_s"] / sd_row["tok_s"]})
    if accept == 3 and not ss:  # Eq. 10's terms alone: the same step, serial, with the overlapped run's roots
        first = rows[0]["mirror"]
        alone = _mirror_run(target, oracle, prompt, reference, EXIT_HIT, gamma, "serial", max_new, drafting,
                            {"budget": max(1, round(first["mean_roots"] or 0))},
                            out / f"trace_{name}_forced_{label}_alone.json")
        first["alone"] = alone | law(alone, first, sd_row)
    return rows


def _mirror_run(target: Transformer, oracle: OracleDraft, prompt: list[int], reference: list[int], hit: float,
                gamma: int, backend: str, max_new: int, drafting: dict[str, Any], options: dict[str, Any],
                trace: Path) -> dict[str, Any]:
    """Mirror-SD with the oracle draft and an exit oracle at ``hit``: speed, its Eq. 10 terms and their sums."""
    # exit_head / exit_vocab: the lens on the full vocabulary, the logits the exit oracle makes up
    mirror, mirror_s = timed_generate(
        ExitOracle.wrap(target, prompt, reference, hit, EXIT_KAPPA), prompt, max_new, method="mirror", draft=oracle,
        gamma=gamma, kappa=EXIT_KAPPA, confidence=0.0, backend=backend, exit_head="lens", exit_vocab=0, **drafting,
        **options)
    info = _mirror(mirror, trace) or {}
    step = info.get("mean_ms", {})
    ratio = lambda key: step["step_s"] / step[key] if step.get(key) else None  # noqa: E731
    return {"tok_s": len(mirror.token_ids) / mirror_s, "backend": backend, "tokens": len(mirror.token_ids),
            "steps": info.get("steps"),
            "mean_accepted": mirror.stats.mean_accepted_length, "equal_to_ar": mirror.token_ids == reference,
            "step_ms": step.get("step_s"), "eq10_ms": step.get("eq10_s"), "predicted_ms": step.get("predicted_s"),
            "terms_ms": step, "step_over_eq10": ratio("eq10_s"), "step_over_predicted": ratio("predicted_s"),
            "device_times": info.get("device_times"), "mean_roots": info.get("mean_roots"),
            "fallback_frequency": info.get("fallback_frequency"),
            "hidden_draft_fraction": info.get("hidden_draft_fraction"), "trace": info.get("trace"),
            "fresh_eta": info.get("fresh_tokens_per_draft_forward"),
            "rollout_eta": info.get("rollout_tokens_per_draft_forward"),
            "rollout_graphs": info.get("rollouts_as_one_graph")}


def law(alone: dict[str, Any], overlapped: dict[str, Any], sd: dict[str, Any]) -> dict[str, Any]:
    """Eq. 10 from terms each measured alone (a serial run: nothing overlaps), with the miss rate × fallback rollout
    and the branch selection: the overlapped run's step as the law predicts it, and so Mirror-SD ÷ SD, with the
    overlapped run's steps at that length and the rest of its wall time (prefills) as measured."""
    t = alone["terms_ms"]
    if not t or not overlapped.get("steps"):
        return {"law_step_ms": None, "law_mirror_over_sd": None}
    step = t["t_pre"] + t["t_ee"] + max(t["delta"], t["t_draft"]) + t["t_fv"] + t["t_fallback"]
    wall = overlapped["tokens"] / overlapped["tok_s"]
    predicted = wall + overlapped["steps"] * (step - overlapped["step_ms"]) / 1e3
    return {"law_step_ms": step, "law_mirror_over_sd": overlapped["tokens"] / predicted / sd["tok_s"]}


def fig4_cells(forced: list[dict[str, Any]]) -> dict[str, dict[tuple[str, str], float]]:
    """Per target, {(method, draft kind): tok/s} at A = :data:`STREAM_ACCEPT`, exit hit rate :data:`EXIT_HIT`, graphs
    off: the four cells of the Mirror-SD paper's Fig. 4 (a failed run leaves its cells out)."""
    cells: dict[str, dict[tuple[str, str], float]] = {}
    for r in forced:
        if r["accept"] != str(STREAM_ACCEPT) or r.get("exit_hit_rate") != EXIT_HIT or "failed" in r \
                or r.get("overlap", "thread") != "thread":
            continue
        kind = r.get("draft", "plain")
        cell = cells.setdefault(r["target"], {})
        cell[("sd", kind)], cell[("mirror", kind)] = r["sd"]["tok_s"], r["mirror"]["tok_s"]
    return cells


def markdown(report: dict[str, Any]) -> str:
    dry = " (DRY RUN on CPU: tiny shapes, numbers mean nothing)" if report["dry_run"] else ""
    lines = [f"# mirrorsd GPU validation{dry}", "", f"Device `{report['device']}`, {report['dtype']}, "
             f"{report['prompt_tokens']}-token prompt, {report['max_new_tokens']} new tokens, γ = {report['gamma']}; "
             f"machine: {json.dumps(report['machine'])}", ""]
    if "cuda_tests" in report:
        lines += [f"CUDA-gated tests: {json.dumps(report['cuda_tests'])}", ""]
    ks = list(next(iter(report["forward_ms"].values())))
    lines += ["## k-token forward (ms; layers replayed as CUDA graphs, and eager)", "",
              "| target | " + " | ".join(f"k={k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
    for key, how in (("forward_ms", ""), ("forward_ms_eager", " eager")):
        for name, curve in report.get(key, {}).items():
            base = curve[min(curve)]
            lines.append(f"| {name}{how} | " + " | ".join(f"{v:.2f} ({v / base:.2f}×)" for v in curve.values())
                         + " |")
    if report.get("costs"):
        copy = report["copy_bytes_per_s"]
        fmt = lambda v, spec=".2f": "–" if v is None else format(v, spec)  # noqa: E731
        lines += ["", f"## A forward's cost against the bandwidth floor (weights' bytes ÷ {copy / 1e12:.2f} TB/s, the "
                  "copy rate measured in this run)", "",
                  "| target | k=1 ms | floor ms | × floor | draft k=1 ms | draft × floor | draft ÷ target | "
                  "k=1 at long context | kernels / layer (draft) | host syncs / step: `ar` (`sd` fixed, `sd` "
                  "confident, `mirror`) |",
                  "|---" * 10 + "|"]
        for c in report["costs"]:
            lines.append(
                f"| {c['target']} | {c['k1_ms']:.2f} | {c['floor_ms']:.2f} | {c['k1_ms'] / c['floor_ms']:.1f}× | "
                f"{c['draft_k1_ms']:.2f} | {c['draft_k1_ms'] / c['draft_floor_ms']:.1f}× | "
                f"{c['draft_k1_ms'] / c['k1_ms']:.2f} | {c['long_k1_ms']:.2f} ms at {c['long_context']} "
                f"({c['long_k1_ms'] / c['k1_ms']:.2f}×) | {fmt(c['kernels_per_layer'], '.1f')} "
                f"({fmt(c['draft_kernels_per_layer'], '.1f')}) | {fmt(c['host_syncs_per_step'], '.1f')} "
                f"({fmt(c['sd_host_syncs_per_step'], '.1f')}, {fmt(c.get('sd_confident_host_syncs_per_step'), '.1f')}, "
                f"{fmt(c.get('mirror_host_syncs_per_step'), '.1f')}) |")
        lines += [f"- {c['target']}: {what} failed: {why}" for c in report["costs"]
                  for what, why in c.get("failed", {}).items()]
        for c in report["costs"]:
            for who in ("kernel_times", "draft_kernel_times"):
                k = c.get(who)
                if not k:
                    continue
                model = c["target"] + ("'s 0.5B-shaped draft" if who.startswith("draft") else "")
                lines += ["", f"### Where a one-token forward's device time goes: {model}", "",
                          f"{k['launches']:.0f} device activities, {k['kernel_us']:.0f} µs of kernel time in a "
                          f"{k['wall_ms'] * 1e3:.0f} µs forward (graphs on, {len(k['top'])} dearest below).", "",
                          "| kernel | launches | µs per forward | share |", "|---|---|---|---|"]
                lines += [f"| `{t['name']}` | {t['launches']:.0f} | {t['us']:.1f} | {t['us'] / k['kernel_us']:.0%} |"
                          for t in k["top"]]
        peers = [c for c in report["costs"] if "peer" in c]
        if peers:
            lines += ["", "## HF transformers' `generate` on the same weights (greedy, tok/s)", "",
                      "| target | tokens | our ar | HF eager | HF static cache + compile | ar ÷ HF compiled |",
                      "|---|---|---|---|---|---|"]
            for c in peers:
                p = c["peer"]
                hf_eager, compiled = p.get("eager"), p.get("static cache + compile")
                show = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
                ratio = f"{p['ar_tok_s'] / compiled:.2f}×" if isinstance(compiled, float) else "–"
                lines.append(f"| {c['target']} | {p['tokens']} | {p['ar_tok_s']:.1f} | {show(hf_eager)} | "
                             f"{show(compiled)} | {ratio} |")
    lines += ["", "## Every method on random weights (greedy)", "",
              "| target | method | tok/s | tokens/step | passes as one graph | equal to ar | divergence |",
              "|---|---|---|---|---|---|---|"]
    for m in report["methods"]:
        if m.get("failed"):
            lines.append(f"| {m['target']} | {m['label']} | – | – | – | FAILED | {m['failed']} |")
            continue
        divergence = json.dumps(m["divergence"]) if m["divergence"] else ""
        graphed = (m.get("stats") or {}).get("passes_as_one_graph")  # (ss: its stream passes replayed)
        lines.append(f"| {m['target']} | {m['label']} | {m['tok_s']:.1f} | {m['mean_accepted']:.2f} | "
                     f"{'–' if graphed is None else format(graphed, '.2f')} | "
                     f"{'yes' if m['equal_to_ar'] else 'NO'} | {divergence} |")
    fmt = lambda v, spec=".2f": "–" if v is None else format(v, spec)  # noqa: E731
    lines += ["", "## Forced acceptance (oracle draft) and exit hit rate (exit oracle): Mirror-SD vs SD", "",
              f"SS draft: untrained streams whose guesses the oracle makes right at {STREAM_HIT} (stream 1's "
              "acceptance); draft η̄ = draft tokens per draft forward (SD / Mirror-SD's fresh, branch rollouts).", "",
              "| target | forced A | draft | exit hit rate | overlap | tokens/step SD / Mirror | "
              "SD tok/s | Mirror tok/s | Mirror/SD | step ms | Eq. 10 ms | step ÷ Eq. 10 / ÷ (Eq. 10 + fallbacks) | "
              "fallback | hidden draft | rollouts as one graph | "
              "draft η̄ | lossless |", "|---" * 17 + "|"]
    for r in report["forced"]:
        head = (f"| {r['target']} | {r['accept']} | {r.get('draft', 'plain')} | {fmt(r.get('exit_hit_rate'))} | "
                f"{r.get('overlap', 'thread')} | ")
        if "failed" in r:
            lines.append(head + f"failed: {r['failed']} |" + " |" * 11)
            continue
        m, s = r["mirror"], r["sd"]
        lossless = "yes" if s["equal_to_ar"] and m["equal_to_ar"] else "NO"
        eta = f"{fmt(s.get('draft_eta'))} / {fmt(m.get('fresh_eta'))}, {fmt(m.get('rollout_eta'))}"
        lines.append(head + f"{s['mean_accepted']:.2f} / {m['mean_accepted']:.2f} | "
                     f"{s['tok_s']:.1f} | {m['tok_s']:.1f} | {r['mirror_over_sd']:.2f}× | {fmt(m['step_ms'])} | "
                     f"{fmt(m['eq10_ms'])} | {fmt(m['step_over_eq10'])} / {fmt(m.get('step_over_predicted'))} | "
                     f"{fmt(m['fallback_frequency'])} | "
                     f"{fmt(m['hidden_draft_fraction'])} | {fmt(m.get('rollout_graphs'))} | {eta} | {lossless} |")
    alone = [(r, r["mirror"]["alone"]) for r in report["forced"] if "alone" in r.get("mirror", {})]
    if alone:
        clock = "CUDA events" if all(a.get("device_times") for _, a in alone) else "the host's clock"
        lines += ["", f"## Eq. 10's terms measured alone (serial, the overlapped run's roots; {clock}), and what the "
                  "law predicts", "",
                  "| target | forced A | T_pre | T_ee | Δ | T_draft | T_fv | miss × fallback | law's step | measured "
                  "step (overlapped) | law's Mirror/SD | measured Mirror/SD |", "|---" * 12 + "|"]
        for r, a in alone:
            t = a["terms_ms"]
            terms = " | ".join(fmt(t.get(k)) for k in ("t_pre", "t_ee", "delta", "t_draft", "t_fv", "t_fallback"))
            law_ratio = a.get("law_mirror_over_sd")
            lines.append(f"| {r['target']} | {r['accept']} | {terms} | {fmt(a.get('law_step_ms'))} | "
                         f"{fmt(r['mirror']['step_ms'])} | {'–' if law_ratio is None else f'{law_ratio:.2f}×'} | "
                         f"{r['mirror_over_sd']:.2f}× |")
    fig4 = fig4_cells(report["forced"])
    if fig4:
        lines += ["", f"## The Mirror-SD paper's Fig. 4 at forced A = {STREAM_ACCEPT}, exit hit rate {EXIT_HIT} "
                  "(tok/s, and ÷ SD with the plain draft)", "",
                  "| target | SD, plain draft | SD, SS draft | Mirror-SD, plain draft | Mirror-SD, SS draft |",
                  "|---|---|---|---|---|"]
        for name, cells in fig4.items():
            base = cells.get(("sd", "plain"))
            show = [f"{v:.1f} ({v / base:.2f}×)" if base and v else "–" for v in
                    (cells.get((method, kind)) for method in ("sd", "mirror") for kind in ("plain", "ss"))]
            lines.append(f"| {name} | " + " | ".join(show) + " |")
    if report.get("train"):
        lines += ["", "## Speculative Streaming training (`train-streams`' step on the target's shape)", "",
                  "| target | recipe | cache ms / chunk | ms / step | train tokens/s | minutes per "
                  f"{CEILING_TOKENS / 1e6:g}M tokens |", "|---|---|---|---|---|---|"]
        for name, t in report["train"].items():
            recipe = f"γ={t['streams']}, N_s={t['layers']}, rank {t['rank']}, {t['vocab']} ids, {t['seq_len']} tok"
            lines.append(f"| {name} | {recipe} | {t['cache_ms_per_chunk']:.1f} | {t['step_ms']:.1f} | "
                         f"{t['train_tokens_per_s']:.0f} | {t['minutes_per_epoch_of_ceiling']:.1f} |")
    if report.get("batched"):
        spec = BATCH_SPECULATION
        lines += ["", "## Continuous batching: requests at once through one batcher (the fused layers, eager)", "",
                  f"`ar` one request after another and batched; `{spec}` batched with its own windows (`fixed`) and "
                  "under the goodput rule, ÷ batched `ar`, with the draft rows a step carried.", "",
                  "| target | requests | `ar` one after another, tok/s | `ar` batched, tok/s | × | most windows in a "
                  f"step | `{spec}` fixed (draft rows a step) | `{spec}` goodput (draft rows a step) | every answer "
                  "its alone one |", "|---|---|---|---|---|---|---|---|---|"]
        for name, rows in report["batched"].items():
            if isinstance(rows, str):
                lines.append(f"| {name} | {rows} | | | | | | | |")
                continue
            for r in rows:
                cells = [(f"{c['tok_s'] / r['batched_tok_s']:.2f}× ({c['draft_rows_per_step']:.1f})", c["equal_alone"])
                         for c in (r.get(f"{spec}_{rule}") for rule in ("fixed", "goodput")) if c is not None]
                equal = r["equal_alone"] and all(ok for _, ok in cells)
                lines.append(f"| {name} | {r['requests']} | {r['alone_tok_s']:.1f} | {r['batched_tok_s']:.1f} | "
                             f"{r['batched_tok_s'] / r['alone_tok_s']:.2f}× | {r['most_windows_in_a_step']} | "
                             + " | ".join(c for c, _ in cells) + f" | {equal} |")
    return "\n".join(lines) + "\n"


def failed_checks(report: dict[str, Any]) -> list[str]:
    """What failed: forced-acceptance runs that raised, and CUDA-gated tests that failed or were cut short (the
    command's exit status is 1 then, as `mirrorsd bench`'s is when a method is not lossless)."""
    failed = [f"forced {r['accept']} ({r.get('draft')} draft)" for r in report["forced"] if "failed" in r]
    tests = report.get("cuda_tests") or {}
    failed += [f"CUDA test {name}" for name in tests.get("failed", {})]
    if tests.get("timed_out"):
        failed.append("CUDA tests (timed out)")
    elif tests.get("ran") and tests.get("returncode") not in (0, None) and not tests.get("failed"):
        failed.append(f"CUDA tests (pytest exit status {tests['returncode']})")
    return failed


def not_lossless(report: dict[str, Any]) -> list[str]:
    """The runs whose tokens differ from ``ar``'s (or from the run alone) beyond a float near-tie."""
    bad = [m["label"] + (" (failed)" if m.get("failed") else "") for m in report["methods"] if not m["equal_to_ar"]
           and (m["divergence"] or {}).get("verdict") != "float near-tie"]
    ran = [r for r in report["forced"] if "failed" not in r]
    bad += [f"forced {r['accept']}{' (SS draft)' if r.get('draft') == 'ss' else ''}" for r in ran
            if not (r["sd"]["equal_to_ar"] and r["mirror"]["equal_to_ar"])]
    for name, rows in report.get("batched", {}).items():
        bad += [f"{name} batched ({rows})"] if isinstance(rows, str) else \
            [f"{name} batched at {r['requests']}" for r in rows if not r["equal_alone"]] + \
            [f"{name} batched {key} at {r['requests']}" for r in rows for key, c in r.items()
             if isinstance(c, dict) and not c["equal_alone"]]
    return bad


def summary(report: dict[str, Any]) -> str:
    bad, ran = not_lossless(report), [r for r in report["forced"] if "failed" not in r]
    ratios = [r["mirror_over_sd"] for r in ran if r.get("exit_hit_rate", EXIT_HIT) == EXIT_HIT
              and r.get("overlap", "thread") == "thread" and r.get("draft", "plain") == "plain"]
    where = "dry run" if report["dry_run"] else report["device"]
    equal = "all equal to ar" if not bad else "NOT equal to ar: " + ", ".join(bad)
    ratio = f"; Mirror/SD at forced acceptance and exit hit rate {EXIT_HIT}, median {statistics.median(ratios):.2f}×" \
        if ratios else ""
    failed = failed_checks(report)
    failed_text = "; FAILED: " + ", ".join(failed) if failed else ""
    return f"{where}: {len(report['methods'])} method runs, {equal}{ratio}{failed_text}"
