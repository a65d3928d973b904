"""A compact Llama-family decoder with layer-wise control (Llama/SmolLM2, Qwen2/2.5, Qwen3, Mistral).

Why our own and not HF's module: speculative methods need to run layers ``[0, l)`` on a window, keep the
hidden states, read early-exit logits, run ``[l, N)`` later, attend with arbitrary tree/stream masks at
explicit positions, and roll the cache back or compact it. HF transformers stays the loader (configs,
tokenizers, GGUF dequantisation) and the oracle our parity tests compare against.

Shapes: tokens and positions are ``[rows, T]``; a mask is boolean ``[rows or 1, T, past + T]`` with True
meaning "may attend"; ``past`` is the number of positions the cache already holds at that layer.

This module is the math and the eager path, the reference every other path matches bit for bit. Loading
(checkpoint folders, weight formats, HF configs) lives in :mod:`mirrorsd.loading`; the fast paths ``run_layers``
dispatches to (bound C++ blocks, CUDA-graph replay) in :mod:`mirrorsd.execution`.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .cuda_graphs import StaticStep
from .execution import (
    KernelBinding,
    LayerCall,
    attention_backends,
    batcher,
    fused_applies,
    fused_layers,
    head_batchable,
    ragged_applies,
    replay,
    replay_forward,
    run_kernels,
)
from .kernels import cuda_attention
from .kv_cache import KVCache
from .linear import (
    DenseLinear,
    PackedLinear,
    PackedWeight,
    QuantLinear,
    fixed_shapes,
    in_fixed_rows,
    make_linear,
    on_huge_pages,
)
from .quant import GroupQuant
from .sampling import Noise, SamplingParams, choose

#: Activation precision of quantized layers (``--activations``): ``int8`` per 32 features, or ``int8x2``, a second
#: int8 plane for each activation's remainder (~15 bits; what small models need on chat prompts, quality.py).
ACTIVATION_FORMATS = ("int8", "int8x2")
Weights = dict[str, "torch.Tensor | GroupQuant | PackedWeight"]

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
# Tokens per forward when a long prompt is cut into pieces (llama.cpp's n_ubatch). One 2,048-token forward of the
# 1.5B runs ~20% slower than four of 512: its activations no longer stay in cache, and buffers above glibc's mmap
# threshold (32 MiB: an MLP's [1024, 8960] fp32) are mapped and zeroed anew by the kernel on every layer.
PREFILL_CHUNK = 512


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, hf_config) -> ModelConfig:
        arch = hf_config.model_type
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {arch!r}; mirrorsd supports {', '.join(SUPPORTED_ARCHS)}")
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("MLP biases (mlp_bias=True) are not supported")
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {hf_config.hidden_act!r} (expected silu)")
        n_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
        window = getattr(hf_config, "sliding_window", None)
        if arch.startswith("qwen") and not getattr(hf_config, "use_sliding_window", False):
            window = None
        return cls(
            arch=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            n_layers=hf_config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            qkv_bias=arch == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=arch == "qwen3",
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            sliding_window=window,
        )

    @property
    def context_length(self) -> int:
        """Longest sequence we attend over exactly (sliding-window models are exact up to the window)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


class SSDeltas(Protocol):
    """Speculative Streaming's stream adapters as the layers see them (:mod:`mirrorsd.decoding.streams.adapters`)."""

    def delta(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor: ...

    def weights(self, layer: int, name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The adapter of one projection as fp32 ``(A [rank, in], B^T [rank, out], scale)``: what the C++ blocks
        add to stream rows (``delta`` is ``(x A^T) B^T · scale``)."""
        ...

    def weight_lists(self, layers: range | list[int]) -> tuple[list, list, list]:
        """:meth:`weights` of every projection of ``layers`` in order, as three lists (A's, B^T's, scales)."""
        ...


@dataclass(frozen=True)
class SSRows:
    """The last ``count`` rows of a window are Speculative Streaming stream rows: their projections get the
    stream adapters' low-rank deltas (main rows keep the base weights, so the target's tokens cannot change)
    and their keys/values are attended in this forward but never kept in the cache (the C++ blocks write them
    past its length)."""

    count: int
    adapters: SSDeltas

    def project(self, layer: int, name: str, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = linear(x)  # one product over main and stream rows: the weights are read once
        if not self.count:
            return out
        s = self.count
        delta = self.adapters.delta(layer, name, x[:, -s:])
        return torch.cat([out[:, :-s], out[:, -s:] + delta.to(out.dtype)], dim=1)


def _project(streams: SSRows | None, layer: int, name: str, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return linear(x) if streams is None else streams.project(layer, name, linear, x)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.fused = False  # set by Transformer: one C++ call instead of eight small ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return kernels.rms_norm(x, self.weight, self.eps)
        if fixed_shapes(x):  # PyTorch lays out a row's mean by how many rows there are
            return in_fixed_rows(self._norm, x)
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, weights: Weights, layer: int, linear: str) -> None:
        super().__init__()
        p = f"layers.{layer}.self_attn."
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.gqa = self.n_heads != self.n_kv_heads
        self.row_exact = False  # set by Transformer for models with quantized (int8-activation) layers
        self.fused = False  # set by Transformer: C++ rotary embedding and batch-invariant attention kernel
        self.q_proj = make_linear(weights[p + "q_proj.weight"], weights.get(p + "q_proj.bias"), linear)
        self.k_proj = make_linear(weights[p + "k_proj.weight"], weights.get(p + "k_proj.bias"), linear)
        self.v_proj = make_linear(weights[p + "v_proj.weight"], weights.get(p + "v_proj.bias"), linear)
        self.o_proj = make_linear(weights[p + "o_proj.weight"], weights.get(p + "o_proj.bias"), linear)
        self.q_norm = RMSNorm(weights[p + "q_norm.weight"], cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(weights[p + "k_norm.weight"], cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None,
        mask: torch.Tensor | None,
        streams: SSRows | None = None,
    ) -> torch.Tensor:
        rows, t, _ = x.shape
        q = _project(streams, self.layer, "q_proj", self.q_proj, x).view(rows, t, self.n_heads, self.head_dim)
        k = _project(streams, self.layer, "k_proj", self.k_proj, x).view(rows, t, self.n_kv_heads, self.head_dim)
        v = _project(streams, self.layer, "v_proj", self.v_proj, x).view(rows, t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fused:
            q, k, v = kernels.rope(q, cos, sin), kernels.rope(k, cos, sin), v.transpose(1, 2)
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        s = streams.count if streams is not None else 0
        if cache is not None:
            main_k, main_v = cache.append(self.layer, k[:, :, : t - s], v[:, :, : t - s])
            if s:  # stream keys/values follow the cached ones for this forward only
                main_k, main_v = torch.cat([main_k, k[:, :, t - s :]], 2), torch.cat([main_v, v[:, :, t - s :]], 2)
            k, v = main_k, main_v
        exact = self.row_exact or fixed_shapes(q)  # CUDA: SDPA's kernels and splits also depend on the query count
        if self.fused:
            out = kernels.attend(q, k, v, mask)  # batch-invariant in one call: main and stream rows alike
        elif exact and s:
            # Main rows exactly as decoding computes them; stream rows only shape proposals, so one batched call.
            main = self._attend_exact(q[:, :, : t - s], k, v, None if mask is None else mask[:, : t - s])
            stream = F.scaled_dot_product_attention(q[:, :, t - s :], k, v, attn_mask=mask[:, t - s :].unsqueeze(1),
                                                    enable_gqa=self.gqa)
            out = torch.cat([main, stream], 2)
        elif exact:
            out = self._attend_exact(q, k, v, mask)
        else:  # a CausalBias (a plain causal window on CUDA, bf16) goes as it is: flash attention, no mask
            attn_mask = mask if mask is None or _is_causal_bias(mask) else mask.unsqueeze(1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=self.gqa)
        out = out.transpose(1, 2).reshape(rows, t, self.n_heads * self.head_dim)
        return _project(streams, self.layer, "o_proj", self.o_proj, out)

    def _attend_exact(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
        if cuda_attention.applies(q):  # one batch-invariant launch for every row (else one SDPA call per row)
            return cuda_attention.attend(q, k, v, *cuda_attention.visible_keys(mask, q.shape[2], k.shape[2], q.device))
        with nullcontext() if q.is_cuda else _one_thread():  # CPU SDPA splits its work by thread count
            if q.shape[2] > 1:
                return self._attend_row_by_row(q, k, v, mask)
            if mask is not None and not bool(mask.all()):  # one query that skips keys (a tree node)
                return self._attend_row_by_row(q, k, v, mask)
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=self.gqa)

    def _attend_row_by_row(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor | None) -> torch.Tensor:
        """Each query exactly as one-token decoding computes it: unmasked SDPA over just the keys it sees,
        in position order. Quantized models need this for every multi-token call (prefill included, since
        methods split prompts differently): their int8 activations turn the last-bit differences between a
        masked multi-query SDPA and a single-query one into different rounding steps, and so into different
        tokens. This way any grouping of tokens into forwards gives bit-identical results."""
        if mask is not None and mask.dtype != torch.bool:
            raise TypeError("attention masks must be boolean (True = attend)")
        rows, _, t, _ = q.shape
        total = k.shape[2]
        out = torch.empty_like(q)
        host_mask = None if mask is None else mask.cpu()  # one device sync per call, not two per row
        for r in range(rows):
            for i in range(t):
                seen = None if host_mask is None else host_mask[r if host_mask.shape[0] > 1 else 0, i]
                count = total - t + i + 1 if seen is None else int(seen.sum())
                if seen is None or bool(seen[:count].all()):  # a prefix of the cache: slice, no copy
                    keys, values = k[r : r + 1, :, :count], v[r : r + 1, :, :count]
                else:
                    index = seen.nonzero().squeeze(1).to(k.device)
                    keys, values = k[r : r + 1].index_select(2, index), v[r : r + 1].index_select(2, index)
                out[r : r + 1, :, i : i + 1] = F.scaled_dot_product_attention(
                    q[r : r + 1, :, i : i + 1], keys, values, enable_gqa=self.gqa)
        return out


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run on one intra-op thread, so a result cannot depend on the caller's thread count (quantized models
    turn last-bit differences into different tokens, and Mirror-SD's ``threads`` backend lowers the target's
    count while the draft runs)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class MLP(nn.Module):
    def __init__(self, weights: Weights, layer: int, linear: str) -> None:
        super().__init__()
        self.layer = layer
        p = f"layers.{layer}.mlp."
        self.gate_proj = make_linear(weights[p + "gate_proj.weight"], linear=linear)
        self.up_proj = make_linear(weights[p + "up_proj.weight"], linear=linear)
        self.down_proj = make_linear(weights[p + "down_proj.weight"], linear=linear)
        self.fused = False  # set by Transformer: the C++ SiLU the fused block uses (the same bits)

    def forward(self, x: torch.Tensor, streams: SSRows | None = None) -> torch.Tensor:
        gate = _project(streams, self.layer, "gate_proj", self.gate_proj, x)
        up = _project(streams, self.layer, "up_proj", self.up_proj, x)
        act = kernels.silu_mul(gate, up) if self.fused else F.silu(gate) * up
        return _project(streams, self.layer, "down_proj", self.down_proj, act)


class Block(KernelBinding, nn.Module):
    def __init__(self, cfg: ModelConfig, weights: Weights, layer: int, linear: str) -> None:
        super().__init__()
        p = f"layers.{layer}."
        self.layer = layer
        self.input_layernorm = RMSNorm(weights[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, weights, layer, linear)
        self.post_attention_layernorm = RMSNorm(weights[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        self.mlp = MLP(weights, layer, linear)
        self.use_kernel = False  # the whole block in one C++ call (bind_kernel)
        self._kernel: torch.ScriptObject | None = None
        self.merged = None  # the fused CUDA layer's weights (execution.merged_weights)

    def forward(self, x, cos, sin, cache, mask, streams: SSRows | None = None) -> torch.Tensor:
        if cache is not None and streams is None and (kernel := self.kernel()) is not None:
            return run_kernels([kernel], [self.layer], self.mlp.down_proj.split_activations, x, cos, sin, cache, mask)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, mask, streams)
        return x + self.mlp(self.post_attention_layernorm(x), streams)


def _causal_bias(t: int, total: int) -> torch.Tensor:
    """SDPA's lower-right causal bias, imported where it is made: ``torch.nn.attention.bias`` imports
    ``torch._dynamo``, which took ~2 s of every ``import mirrorsd`` (2 cores, AMD EPYC, ISA: avx2) for a mask only
    half-precision CUDA windows use."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(t, total)


def _is_causal_bias(mask: torch.Tensor) -> bool:
    bias = sys.modules.get("torch.nn.attention.bias")  # none can exist before the module is imported
    return bias is not None and isinstance(mask, bias.CausalBias)


def causal_mask(past: int, t: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[1, t, past + t]``: the window sees the whole cache and itself causally."""
    q = torch.arange(t, device=device).unsqueeze(1) + past
    k = torch.arange(past + t, device=device).unsqueeze(0)
    return (k <= q).unsqueeze(0)


#: Caches kept per model for later requests (:meth:`Transformer.lease_cache`), with the graphs captured over them.
SPARE_CACHES = 2
_SPARE_LOCK = threading.Lock()


class QuantEmbedding(nn.Module):
    """A quantized checkpoint's embedding, kept quantized: a forward dequantizes only the rows it looks up (the
    same arithmetic row by row, so the same bits as dequantizing the whole table). A dense fp32 copy of the 1.5B's
    151,936 × 1,536 table held 0.93 GB for the model's lifetime."""

    def __init__(self, weight: GroupQuant) -> None:
        super().__init__()
        self.quant = weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.quant.select_rows(tokens.reshape(-1)).dequantize()
        return rows.view(*tokens.shape, rows.shape[-1])

    @property
    def weight(self) -> torch.Tensor:
        """The whole table in fp32, made on each read (a tied head's or a trainer's reference rows)."""
        return self.quant.dequantize()


class Transformer(nn.Module):
    """Decoder-only LM. Build with :meth:`from_pretrained` (local HF folder), :meth:`from_hf` (an HF model) or
    :meth:`from_state` (an HF config and a state dict)."""

    #: Whether :meth:`forward` may replay a whole forward as one CUDA graph (a subclass that reshapes what
    #: :meth:`run_layers` or :meth:`logits` return turns it off: a captured forward would not call them).
    whole_forward_graphs = True

    def __init__(self, cfg: ModelConfig, weights: Weights, inv_freq: torch.Tensor, rope_scale: float = 1.0,
                 linear: str = "auto") -> None:
        super().__init__()
        self.config = cfg
        embed = weights["embed_tokens.weight"]
        self.embed_tokens = (QuantEmbedding(embed) if isinstance(embed, GroupQuant)
                             else nn.Embedding.from_pretrained(embed, freeze=True))
        self.layers = nn.ModuleList(Block(cfg, weights, i, linear) for i in range(cfg.n_layers))
        self.norm = RMSNorm(weights["norm.weight"], cfg.rms_norm_eps)
        head = weights.get("lm_head.weight")
        if head is None and not cfg.tie_word_embeddings:  # (a checkpoint short of its head's shard: it read as tied)
            raise ValueError("the checkpoint has no lm_head.weight and its config does not tie the head to the "
                             "embedding (tie_word_embeddings false): a weights file is missing")
        if head is None or (cfg.tie_word_embeddings and not isinstance(head, GroupQuant | PackedWeight)):
            head = embed  # tied (a quantized copy of the embedding, from q8/q4 loading, is kept as the head)
        self.lm_head = make_linear(head, linear=linear)
        # Quantized models must give bit-identical results however tokens are grouped into forwards.
        self._route(any(isinstance(m, QuantLinear) for m in self.modules()))
        on_huge_pages(self)
        self.register_buffer("inv_freq", inv_freq.float().to(self.device), persistent=False)
        self.rope_scale = rope_scale
        self.activations = "int8"

    def use_activations(self, activations: str) -> Transformer:
        """Set the activation precision of every quantized layer (see :data:`ACTIVATION_FORMATS`)."""
        if activations not in ACTIVATION_FORMATS:
            raise ValueError(f"activations must be one of {ACTIVATION_FORMATS}, got {activations!r}")
        for module in self.modules():
            if isinstance(module, QuantLinear):
                module.split_activations = activations == "int8x2"
        self.activations = activations
        return self

    def make_row_exact(self) -> bool:
        """Put an fp32 CPU model on the row-exact path quantized models always take: the C++ fp32 linear for every
        row count and the C++ norms, rotary embedding and attention, so a row's bits do not depend on the other rows
        of its forward (a verification window, a tree, or other requests in a continuous batch). PyTorch's GEMM
        promises no such thing. Prompts run slower than through its GEMM. Returns whether the model is row-exact
        now (False where the C++ kernels or the shapes do not apply: the model is left as it was)."""
        if not self.row_exact:
            if any(isinstance(m, DenseLinear) for m in self.modules()) or not self._fusable():
                return False
            self._route(True)
        return self.fused

    def _fusable(self) -> bool:
        """The C++ layers take fp32 on a CPU, head_dim a multiple of 16 up to 256 (their attention's registers)."""
        return kernels.available() and self.config.head_dim % 16 == 0 and self.config.head_dim <= 256 \
            and self.dtype == torch.float32 and self.device.type == "cpu"

    def _route(self, row_exact: bool) -> None:
        """Row-exact models take the row-local C++ layers where they apply, bit-identical however tokens are
        grouped into forwards."""
        self.row_exact = row_exact
        fused = row_exact and self._fusable()
        for module in self.modules():
            if isinstance(module, Attention | PackedLinear):
                module.row_exact = row_exact
            if isinstance(module, Attention | RMSNorm | MLP):
                module.fused = fused
        for block in self.layers:
            block.bind_kernel()

    # -- construction (in mirrorsd.loading) ------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf_model: nn.Module, linear: str = "auto") -> Transformer:
        """Build from the weights of an HF ``*ForCausalLM`` (``linear="dense"`` shares their storage)."""
        from .loading import from_hf

        return from_hf(cls, hf_model, linear)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, weights: str = "fp32",
                        linear: str = "auto", activations: str = "int8",
                        deltas: dict[str, torch.Tensor] | None = None) -> Transformer:
        """Load a local HF checkpoint folder (config.json + *.safetensors).

        ``weights`` picks the weight format (see :data:`~mirrorsd.loading.WEIGHT_FORMATS`): ``fp32`` the checkpoint
        as is, ``q8`` our per-32 int8 quantization of it, ``q4`` the folder's original ``model.gguf`` codes (zoo
        models keep it; Q4_K_M files mix 4-bit with some 6/8-bit tensors). Quantized formats run on CPU only, with
        ``activations`` as their activation precision (:data:`ACTIVATION_FORMATS`). ``linear`` picks the linear
        implementation (:data:`~mirrorsd.linear.LINEAR_IMPLS`): ``auto`` by format and device (our CPU kernels
        where they apply), ``dense`` PyTorch's stock GEMMs. ``deltas``: state-dict name → tensor added to that weight
        before quantization (a tuned draft's, :mod:`mirrorsd.tuned_drafts`).
        """
        from .loading import from_pretrained

        return from_pretrained(cls, path, device, dtype, weights, linear, activations, deltas)

    @classmethod
    def from_state(cls, hf_config, state: Weights, linear: str = "auto") -> Transformer:
        """Build from an HF config and a state dict in memory: keys without HF's ``model.`` prefix, values
        tensors or (quantized projections) :class:`~mirrorsd.quant.GroupQuant` codes. What tests and custom
        loaders use to build a model from weights they made; the other constructors end here."""
        from .loading import from_state

        return from_state(cls, hf_config, state, linear)

    def prefix_model(self, n_layers: int) -> Transformer:
        """A self-draft sharing this model's first ``n_layers`` blocks, final norm and LM head (no copy)."""
        if not 0 < n_layers <= self.config.n_layers:
            raise ValueError(f"n_layers must be in 1..{self.config.n_layers}, got {n_layers}")
        draft = object.__new__(type(self))
        nn.Module.__init__(draft)
        draft.config = ModelConfig(**{**self.config.__dict__, "n_layers": n_layers})
        draft.embed_tokens, draft.norm, draft.lm_head = self.embed_tokens, self.norm, self.lm_head
        draft.layers = nn.ModuleList(list(self.layers[:n_layers]))
        draft.register_buffer("inv_freq", self.inv_freq, persistent=False)
        draft.rope_scale = self.rope_scale
        draft.row_exact = self.row_exact
        draft.activations = self.activations
        return draft

    # -- execution ----------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def fused(self) -> bool:
        """On the C++ path: batch-invariant end to end, so a long prompt may run in pieces, bit for bit."""
        return bool(self.layers) and self.layers[0].self_attn.fused

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def new_cache(self, rows: int = 1, capacity: int = 256) -> KVCache:
        cfg = self.config
        return KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, rows=rows, capacity=capacity,
                       dtype=self.dtype, device=self.device)

    @property
    def spare_caches(self) -> list[KVCache]:
        """Returned caches waiting for a request (on the model itself: their graphs' keys hold the model)."""
        return self.__dict__.setdefault("_spare_caches", [])

    def lease_cache(self, capacity: int) -> KVCache:
        """A one-row cache for one request, to hand back with :meth:`return_cache`. On CUDA it is a returned cache
        that fits, when there is one: the CUDA graphs captured over its buffers then replay from the request's first
        step, where a new cache's shapes run eagerly twice (issued kernel by kernel) and are captured on the third.
        New ones get a power-of-two capacity, so caches of similar requests fit each other."""
        if self.device.type != "cuda":
            return self.new_cache(capacity=capacity)
        with _SPARE_LOCK:
            spare = self.spare_caches
            fits = [cache for cache in spare if cache.capacity >= capacity]
            if fits:
                cache = min(fits, key=lambda c: c.capacity)
                spare.remove(cache)
                cache.truncate(0)
                return cache
        return self.new_cache(capacity=1 << max(8, (capacity - 1).bit_length()))

    def return_cache(self, cache: KVCache) -> None:
        """Hand back a cache from :meth:`lease_cache` once its request is over (keeping the last few on CUDA)."""
        if self.device.type != "cuda" or cache.rows != 1:
            return
        torch.cuda.synchronize(self.device)  # every stream's work on it is done before another request writes it
        with _SPARE_LOCK:
            spare = self.spare_caches
            spare.append(cache)
            del spare[:-SPARE_CACHES]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale).to(self.dtype), (emb.sin() * self.rope_scale).to(self.dtype)

    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
        start: int = 0,
        end: int | None = None,
        streams: SSRows | None = None,
        static: StaticStep | None = None,
    ) -> torch.Tensor:
        """Run blocks ``[start, end)`` on a window's hidden states ``[rows, T, hidden]``.

        With ``mask=None`` the window is causal over the cache (no mask at all for a single token).
        ``streams`` marks the window's trailing rows as Speculative Streaming stream rows (give a mask then).
        ``static``: the window's cache slots and visible keys as device tensors, for a caller that captures a whole
        sequence of forwards as one CUDA graph (the fused path only; the caller advances the cache's lengths).
        """
        if streams is not None and streams.count and mask is None and static is None:
            raise ValueError("stream rows need an explicit attention mask (or static gather lists)")
        end = self.config.n_layers if end is None else end
        if static is not None:
            if not fused_applies(self, hidden) or mask is not None:
                raise ValueError("static inputs need the fused CUDA layers, and carry the visible keys (no mask)")
            return fused_layers(self, hidden, positions, cache, None, start, end, streams, static=static)
        t = hidden.shape[1]
        hook = batcher()
        if hook is not None and cache is not None and hidden.shape[0] == 1 and not torch.is_grad_enabled() \
                and ragged_applies(self, start, end):  # continuous batching: one forward for all requests
            return hook.run_layers(self, LayerCall(hidden, positions, cache, mask, streams), start, end)
        replayed = None if streams is not None else replay(self, hidden, positions, cache, mask, start, end)
        if replayed is not None:
            return replayed
        if fused_applies(self, hidden):
            return fused_layers(self, hidden, positions, cache, mask, start, end, streams)
        if mask is None and t > 1 and not fixed_shapes(hidden):  # (batch-invariant CUDA attention needs no mask)
            past = cache.lengths[start] if cache is not None else 0
            # On CUDA in half precision a CausalBias: flash attention aligns it lower right itself, with no mask
            # tensor (fp32 has no flash kernel; CausalBias would then build its mask in every layer).
            flash = hidden.is_cuda and hidden.dtype in (torch.float16, torch.bfloat16)
            mask = _causal_bias(t, past + t) if flash else causal_mask(past, t, hidden.device)
        cos, sin = self.rope(positions)
        blocks = list(self.layers)[start:end]  # (slicing the ModuleList itself builds a new module: ~60 us)
        # Every block bound to the C++ op: one call for all of them (stream rows too, outside training: the op has no
        # autograd).
        if cache is not None and (streams is None or not torch.is_grad_enabled()):
            bound = [block.kernel() for block in blocks]
            if bound and all(kernel is not None for kernel in bound):
                splits = {block.mlp.down_proj.split_activations for block in blocks}
                if len(splits) == 1:
                    return run_kernels(bound, list(range(start, end)), splits.pop(), hidden, cos, sin, cache, mask,
                                       streams)
        with attention_backends(hidden.device):
            for block in blocks:
                hidden = block(hidden, cos, sin, cache, mask, streams)
        return hidden

    def logits(self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Final norm + LM head on any layer's hidden states (this is also the early exit); ``head``: another head
        on the normed states (a draft's reduced vocabulary). A continuous batcher's member sends them to the batch's
        engine thread, as its layers: run on the member's own thread, the head's parallel product met the engine's
        idle OpenMP team and ran at half speed (`ss`'s 1.5B main head, 5.7 -> 10 ms)."""
        hook = batcher()
        if hook is not None:  # rows of one sequence, [1, T, h] or [T, h] (a tree's or a stream's rows)
            rows = hidden if hidden.dim() == 3 else hidden.unsqueeze(0)
            if head_batchable(self, rows, head):
                out = hook.head(self, rows, head)
                return out if hidden.dim() == 3 else out[0]
        return self.lm_head(self.norm(hidden)).float() if head is None else head(self.norm(hidden))

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
        last: int | None = None,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits ``[rows, T, vocab]`` for a window; positions default to continuing the cache.

        ``last=n`` returns only the last ``n`` rows' logits: the LM head is the largest matrix of a small
        model, so a prefill or a draft catch-up should not pay it for rows nobody reads. ``head``: another
        head on the normed states (a draft's reduced vocabulary, :mod:`mirrorsd.draft_vocab`).
        """
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        if positions is None:
            past = cache.lengths[0] if cache is not None else 0
            positions = torch.arange(past, past + tokens.shape[1], device=tokens.device).expand_as(tokens)
        elif positions.dim() == 1:
            positions = positions.unsqueeze(0).expand_as(tokens)
        keep = tokens.shape[1] if last is None else last
        if head is None and self.whole_forward_graphs:
            logits = replay_forward(self, tokens, positions, cache, mask, keep)
            if logits is not None:
                return logits
        hidden = self._run_window(tokens, positions, cache, mask, keep)
        hidden = hidden if last is None else hidden[:, -last:]
        return self.logits(hidden, head)

    def forward_and_choose(self, tokens: torch.Tensor, params: SamplingParams, cache: KVCache | None = None,
                           noise: int = Noise.TARGET) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`'s logits for a window continuing ``cache``, and the token each row chooses
        (:func:`~mirrorsd.sampling.choose`, keyed by the position after the row's): ``[rows, T, vocab]`` and
        ``[rows, T]``, left on the device. Where the whole forward replays as one graph the choice is inside it, so
        a step queues no kernels of its own after the replay (issue 61's one graph per step)."""
        tokens = tokens if tokens.dim() == 2 else tokens.unsqueeze(0)
        past = cache.lengths[0] if cache is not None else 0
        positions = torch.arange(past, past + tokens.shape[1], device=tokens.device).expand_as(tokens)
        if self.whole_forward_graphs:
            out = replay_forward(self, tokens, positions, cache, None, tokens.shape[1], (params, noise))
            if out is not None:
                return out
        logits = self.logits(self._run_window(tokens, positions, cache, None, tokens.shape[1]))  # (no other graph)
        at = positions + 1
        return logits, choose(logits.reshape(-1, logits.shape[-1]), at.reshape(-1), params, noise).view(at.shape)

    def prefill(self, tokens: torch.Tensor, cache: KVCache) -> None:
        """Fill the cache with a prompt's keys and values; no logits (the LM head is skipped entirely)."""
        tokens = tokens if tokens.dim() == 2 else tokens.unsqueeze(0)
        past = cache.lengths[0]
        positions = torch.arange(past, past + tokens.shape[1], device=tokens.device).expand_as(tokens)
        self._run_window(tokens, positions, cache, None, keep=0)

    def prefill_at(self, tokens: torch.Tensor, cache: KVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A prompt's prefill that also keeps what its last token has made: its logits ``[1, vocab]`` and its hidden
        state entering block ``layer`` ``[1, 1, hidden]``. Speculative Streaming inserts its streams there, so the
        prompt's last token drafts the first tree without a forward of its own."""
        tokens = tokens if tokens.dim() == 2 else tokens.unsqueeze(0)
        past = cache.lengths[0]
        positions = torch.arange(past, past + tokens.shape[1], device=tokens.device).expand_as(tokens)
        step = self._piece(tokens, cache, None)
        for begin in range(0, tokens.shape[1], step):
            piece = slice(begin, begin + step)
            low = self.run_layers(self.embed(tokens[:, piece]), positions[:, piece], cache, None, 0, layer)
            out = self.run_layers(low, positions[:, piece], cache, None, layer, None)
        return self.logits(out[:, -1:])[0], low[:, -1:]

    def _piece(self, tokens: torch.Tensor, cache: KVCache | None, mask: torch.Tensor | None) -> int:
        """How many tokens of a causal window one call runs: on the batch-invariant path pieces of PREFILL_CHUNK
        tokens per row, which gives the same bits faster; elsewhere all of them."""
        rows, t = tokens.shape
        if not self.fused or cache is None or mask is not None:
            return t
        return min(t, max(1, PREFILL_CHUNK // rows))

    def _run_window(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | None,
                    mask: torch.Tensor | None, keep: int) -> torch.Tensor:
        """All blocks on a causal window; the hidden states of (at least) its last ``keep`` tokens, run in
        :meth:`_piece`'s pieces."""
        t = tokens.shape[1]
        step = self._piece(tokens, cache, mask)
        if t <= step:
            return self.run_layers(self.embed(tokens), positions, cache, mask)
        kept = []
        for begin in range(0, t, step):
            hidden = self.run_layers(self.embed(tokens[:, begin : begin + step]), positions[:, begin : begin + step],
                                     cache)
            if begin + step > t - keep:
                kept.append(hidden)
        return torch.cat(kept, 1) if kept else hidden[:, :0]
