"""Speculative Streaming's multi-stream attention (MSA) pieces, over our :class:`~mirrorsd.model.Transformer`.

The top ``N_s`` layers carry ``γ`` speculative streams beside each main-stream token: at layer ``N - N_s``
stream ``j`` of token ``t`` starts as ``S_tj = M_t + P_j`` (a learned stream embedding, f_η = identity as in
the paper), runs through the same blocks and is decoded by the model's own final norm and LM head, predicting
the token ``j`` places after the main stream's. Stream ``(t, j)`` attends to main positions ``<= t`` (its tree
ancestors, in decoding) and to streams ``(t, 1..j)``; the main stream stays plain causal (v1) and stream
keys/values are never cached.

Lossless mode (the only mode here): base weights are frozen and main rows use them alone. The trainable
pieces are the stream embeddings, peft LoRA adapters on the top layers' projections that apply to stream rows
only, and the pruning adapter (identity + rank-r map on layer ``N - N_s`` states, read through the LM head)
that scores tree edges. The target's own tokens therefore cannot change.
"""

from __future__ import annotations

import json
import math
import threading
import warnings
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ... import kernels
from ...draft_vocab import SubsetHead, head_logits, optional_head
from ...execution import PROJECTIONS
from ...files import save_tensors, write_text
from ...model import SSRows, Transformer

CONFIG_FILE, WEIGHTS_FILE = "stream_config.json", "adapter.safetensors"
SHIPPED = Path(__file__).parents[2] / "data" / "streams"


@dataclass(frozen=True)
class StreamConfig:
    streams: int = 3  # γ (PMLR: 3)
    layers: int = 4  # N_s (PMLR: 4)
    rank: int = 8  # LoRA rank on stream rows (the paper's 32 would make shipped files 4x larger)
    alpha: int = 16
    prune_rank: int = 8  # the paper's θ
    # What the adapter was trained on, checked when it is attached to a model.
    hidden_size: int = 0
    n_layers: int = 0
    vocab_size: int = 0
    recipe: dict = field(default_factory=dict)

    def check(self, model: Transformer) -> None:
        cfg = model.config
        got = (cfg.hidden_size, cfg.n_layers, cfg.vocab_size)
        if got != (self.hidden_size, self.n_layers, self.vocab_size):
            raise ValueError(f"stream adapter was trained for hidden/layers/vocab {self.hidden_size}/{self.n_layers}/"
                             f"{self.vocab_size}, the model has {got[0]}/{got[1]}/{got[2]}")
        if not 1 <= self.layers < cfg.n_layers:
            raise ValueError(f"stream layers N_s must be in 1..{cfg.n_layers - 1}, got {self.layers}")
        if self.streams < 1:
            raise ValueError(f"streams must be >= 1, got {self.streams}")


def version(weight: torch.Tensor) -> int:
    """How many times ``weight`` was changed in place (training's steps), for the copies made of it. An adapter made
    under ``torch.inference_mode`` holds inference tensors, which keep no count (and which training cannot step): -1."""
    return -1 if weight.is_inference() else weight._version


class PruneAdapter(nn.Module):
    """o_θ: identity + rank-r residual (B starts at 0, so an untrained adapter is the plain logit lens)."""

    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(hidden, rank, bias=False)
        self.up = nn.Linear(rank, hidden, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.up(self.down(hidden.to(self.up.weight.dtype))).to(hidden.dtype)


class StreamAdapters(nn.Module):
    """The trainable Speculative Streaming pieces attached to one model (its linears are wrapped, not copied)."""

    def __init__(self, model: Transformer, config: StreamConfig) -> None:
        from peft import LoraConfig
        from peft.tuners.lora.layer import Linear as LoraLinear

        super().__init__()
        config.check(model)
        self.config = config
        self.first_layer = model.config.n_layers - config.layers  # N - N_s: streams are inserted here
        hidden = model.config.hidden_size
        self.stream_embed = nn.Parameter(torch.zeros(config.streams, hidden, device=model.device))
        lora_config = LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=0.0)
        self.lora = nn.ModuleDict()
        with warnings.catch_warnings():  # peft warns that our quantized linears are not nn.Linear; it only
            warnings.simplefilter("ignore")  # reads their in/out features, and we compute the base product
            for layer in range(self.first_layer, model.config.n_layers):
                block = model.layers[layer]
                for name in PROJECTIONS:
                    parent = block.self_attn if name in PROJECTIONS[:4] else block.mlp
                    self.lora[f"{layer}_{name}"] = LoraLinear(getattr(parent, name), "default", config=lora_config,
                                                              r=config.rank, lora_alpha=config.alpha)
        self.prune = PruneAdapter(hidden, config.prune_rank).to(model.device)
        self.cpu_op = model.device.type == "cpu" and kernels.available()  # :meth:`delta`'s C++ path
        self._transposed: dict[str, tuple[tuple[int, int], torch.Tensor]] = {}  # :meth:`weights`' B^T
        self._lists: dict[tuple[int, ...], tuple[list, tuple[list, list, list]]] = {}  # :meth:`weight_lists`
        for module in self.lora.values():
            module.base_layer.requires_grad_(False)  # the wrapped base layers stay frozen
            module.lora_A.float()  # the trained parts stay fp32 whatever dtype the base runs in
            module.lora_B.float()  # (AdamW on bf16 weights loses small updates)

    # -- what the model calls --------------------------------------------------------------------------

    def delta(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        """``(x A^T) B^T · scale``: outside training on a CPU through the op the C++ blocks call (one call instead of
        ATen's two tiny products, and the same bits as those blocks), else through peft's modules."""
        lora = self.lora[f"{layer}_{name}"]
        down = lora.lora_A["default"]
        if self.cpu_op and not torch.is_grad_enabled() and x.device.type == "cpu":
            return kernels.lora_delta(x.to(down.weight.dtype), *self.weights(layer, name))
        return lora.lora_B["default"](down(x.to(down.weight.dtype))) * lora.scaling["default"]

    def weights(self, layer: int, name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``(A, B^T, scale)``: B^T is kept transposed beside the adapter (the C++ rows share its loads), made again
        when training has changed B."""
        key = f"{layer}_{name}"
        lora = self.lora[key]
        b = lora.lora_B["default"].weight
        stamp = (b.data_ptr(), version(b))
        cached = self._transposed.get(key)
        if cached is None or cached[0] != stamp:
            cached = self._transposed[key] = (stamp, b.detach().t().contiguous())
        return lora.lora_A["default"].weight, cached[1], float(lora.scaling["default"])

    def weight_lists(self, layers: range | list[int]) -> tuple[list, list, list]:
        """:meth:`weights` of every projection of ``layers``, as the C++ stream blocks take them (A's, B^T's, scales).
        Kept between passes and checked by the B's versions alone: through the modules, 28 lookups cost the 0.5B's
        pass ~0.3 ms (3%)."""
        key = tuple(layers)
        kept = self._lists.get(key)
        if kept is not None and all(version(b) == v and b.data_ptr() == p for b, v, p in kept[0]):
            return kept[1]
        weights = [self.weights(layer, name) for layer in key for name in PROJECTIONS]
        bs = [self.lora[f"{layer}_{name}"].lora_B["default"].weight for layer in key for name in PROJECTIONS]
        lists = ([a for a, _, _ in weights], [b for _, b, _ in weights], [s for _, _, s in weights])
        self._lists[key] = ([(b, version(b), b.data_ptr()) for b in bs], lists)
        return lists

    def stream_count(self, asked: int | None) -> int:
        """The streams a pass runs: ``asked`` (0 or None: all) capped at those trained, so a busy batch's cap or a
        user's option never asks for a stream that has no embedding."""
        return min(asked or self.config.streams, self.config.streams)

    def rows(self, count: int) -> SSRows:
        return SSRows(count, self)

    def insert(self, main: torch.Tensor, streams: int | None = None) -> torch.Tensor:
        """``[rows, m, h]`` main states at layer N - N_s → ``[rows, m + m·γ, h]``: the main rows, then stream
        ``(i, j)`` at ``m + i·γ + j - 1`` as ``M_i + P_j`` (``streams``: only the first γ' of them)."""
        rows, m, h = main.shape
        embed = self.stream_embed[:streams or self.config.streams].to(main.dtype)
        streams = (main.unsqueeze(2) + embed).reshape(rows, m * embed.shape[0], h)
        return torch.cat([main, streams], dim=1)

    @property
    def train_vocab(self) -> int:
        """The restricted vocabulary the streams were trained on (0: the full one): ids outside it never got a
        gradient, so decoding reads the streams and the pruning exit through the same subset by default."""
        return int(self.config.recipe.get("train_vocab", 0))

    def head(self, model: Transformer, vocab: int | None = None) -> SubsetHead | None:
        """The head stream rows and the pruning exit are read through: ``vocab`` ids (0: all), by default the
        training vocabulary."""
        return optional_head(model, self.train_vocab if vocab is None else vocab)

    def prune_logits(self, model: Transformer, hidden: torch.Tensor,
                     head: SubsetHead | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Early-exit logits H(o_θ(M)) at the pruning layer (the layer where streams are inserted), with the
        token each column scores (:func:`~mirrorsd.draft_vocab.head_logits`)."""
        return head_logits(model, self.prune(hidden), head)

    # -- persistence -------------------------------------------------------------------------------------

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def adapter_state(self) -> dict[str, torch.Tensor]:
        state = {"stream_embed": self.stream_embed, "prune.down": self.prune.down.weight,
                 "prune.up": self.prune.up.weight}
        for key, lora in self.lora.items():
            state[f"lora.{key}.A"] = lora.lora_A["default"].weight
            state[f"lora.{key}.B"] = lora.lora_B["default"].weight
        return state

    def load_adapter_state(self, state: dict[str, torch.Tensor]) -> None:
        own = self.adapter_state()
        missing = sorted(set(own) - set(state))
        if missing:
            raise ValueError(f"stream adapter file lacks {missing[:3]}{'...' if len(missing) > 3 else ''}")
        with torch.no_grad():
            for key, tensor in own.items():
                if state[key].shape != tensor.shape:
                    raise ValueError(f"stream adapter tensor {key} has shape {tuple(state[key].shape)}, "
                                     f"expected {tuple(tensor.shape)}")
                tensor.copy_(state[key].to(tensor.dtype))

    def save(self, folder: str | Path, recipe: dict | None = None) -> Path:
        """``adapter.safetensors`` (fp16: the shipped files stay a few MB), then ``stream_config.json``, each whole."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = asdict(self.config) | ({"recipe": recipe} if recipe is not None else {})
        save_tensors({k: v.detach().to("cpu", torch.float16).contiguous() for k, v in self.adapter_state().items()},
                     folder / WEIGHTS_FILE)
        write_text(folder / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
        return folder


def shipped_adapter(model_name: str) -> Path | None:
    """The adapter folder shipped in the package for a zoo model, if any."""
    folder = SHIPPED / model_name
    return folder if (folder / CONFIG_FILE).exists() else None


def resolve_adapter(source: str | Path, model_name: str | None = None) -> Path:
    """A folder with ``stream_config.json``: a path, or a zoo name with a shipped adapter."""
    path = Path(source)
    if (path / CONFIG_FILE).exists():
        return path
    shipped = shipped_adapter(str(source))
    if shipped is not None:
        return shipped
    hint = f" (model {model_name!r})" if model_name else ""
    raise FileNotFoundError(f"no stream adapter at {source!s}{hint}: expected a folder with {CONFIG_FILE} and "
                            f"{WEIGHTS_FILE} (train one with `mirrorsd train-streams`), or a zoo name with a "
                            f"shipped adapter: {', '.join(sorted(p.name for p in SHIPPED.glob('*'))) or 'none'}")


def extra_parameters(folder: str | Path) -> dict[str, int]:
    """A saved adapter's parameters by part, read from the file's header (nothing is loaded): the stream embeddings
    (γ·h), the pruning adapter o_θ (2·r·h) and the stream rows' LoRA. The SS paper's Table 1 counts the first two
    only (its baseline is LoRA fine-tuned too); in the lossless mode we ship, the LoRA serves the streams alone."""
    from safetensors import safe_open

    parts = {"stream_embed": 0, "prune": 0, "lora": 0}
    with safe_open(str(Path(folder) / WEIGHTS_FILE), "pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            part = key.split(".")[0]
            if part not in parts:
                raise ValueError(f"unknown adapter tensor {key!r} in {folder}")
            parts[part] += math.prod(f.get_slice(key).get_shape())
    return parts


def medusa_parameters(hidden: int, vocab: int, heads: int) -> int:
    """Medusa-1 heads as the SS paper's baseline sizes them: per head one residual block (an h×h linear) and an LM
    head of its own (h·v). Its Table 1 column is exactly heads·(h² + h·v): the block's bias is left out there."""
    return heads * (hidden * hidden + hidden * vocab)


# Adapters attached per model and folder, with the file version they were read from: building peft's modules and
# reading the file took ~24 ms per request on the 1.5B (~20% of a short SmolLM2 answer). Decoding only reads them;
# a re-saved file replaces its folder's entry, so checkpoints do not pile up. The lock: two requests that start at
# once (a server's batch) must get the same copy, as one batched call takes the stream rows of one adapter only.
_ATTACHED: weakref.WeakKeyDictionary[Transformer, dict[str, tuple[int, StreamAdapters]]] = weakref.WeakKeyDictionary()
_ATTACHING = threading.Lock()


def load_adapters(model: Transformer, source: str | Path | StreamAdapters,
                  model_name: str | None = None) -> StreamAdapters:
    """Attach a saved adapter (folder or shipped zoo name) to ``model``; an attached one passes through. Decoding
    shares one attached copy per model and file (train a fresh :class:`StreamAdapters` instead of this one)."""
    from safetensors.torch import load_file

    if isinstance(source, StreamAdapters):
        return source
    folder = resolve_adapter(source, model_name)
    weights = folder / WEIGHTS_FILE
    version = weights.stat().st_mtime_ns if weights.exists() else 0  # (a missing file fails in load_file below)
    key = str(folder.resolve())
    with _ATTACHING:
        attached = _ATTACHED.setdefault(model, {})
        if key not in attached or attached[key][0] != version:
            config = StreamConfig(**json.loads((folder / CONFIG_FILE).read_text()))
            adapters = StreamAdapters(model, config)
            adapters.load_adapter_state(load_file(str(weights), device=str(model.device)))
            attached[key] = (version, adapters.eval())
        return attached[key][1]


def msa_mask(ancestors: torch.Tensor, past: int, streams: int) -> torch.Tensor:
    """``[1, m + m·γ, past + m + m·γ]`` boolean mask for the MSA layers (True = attend).

    ``ancestors[a, b]`` says main row ``a`` sees main row ``b`` (causal in training, tree ancestors in decoding,
    each row seeing itself); every row sees the ``past`` cached positions. Stream ``(a, j)`` sees what main
    ``a`` sees, ``a`` itself and streams ``(a, 1..j)``; main rows see no stream (v1's Eq. 1).
    """
    m = ancestors.shape[0]
    main = torch.cat([torch.ones(m, past, dtype=torch.bool, device=ancestors.device), ancestors], 1)
    return stream_mask(main, torch.arange(m, device=ancestors.device), streams)


def stream_mask(main: torch.Tensor, streamed: torch.Tensor, streams: int) -> torch.Tensor:
    """:func:`msa_mask` for any main mask ``[m, T]`` (what each main row sees of the cache and the window, the
    window's main rows being the last ``m`` columns) with stream rows beside the main rows ``streamed`` only:
    ``[1, m + s·γ, T + s·γ]``. Mirror-SD's branch rollouts need it: each branch sees its own part of the cache."""
    m, total = main.shape
    s = streamed.numel()
    mask = torch.zeros(m + s * streams, total + s * streams, dtype=torch.bool, device=main.device)
    mask[:m, :total] = main
    mask[m:, :total] = main[streamed].repeat_interleave(streams, dim=0)
    j = torch.arange(streams, device=main.device)
    own = (j.unsqueeze(1) >= j.unsqueeze(0))  # [γ, γ]: stream j sees streams <= j of its own token
    mask[m:, total:] = torch.block_diag(*([own] * s)) if s else own[:0, :0]
    return mask.unsqueeze(0)
