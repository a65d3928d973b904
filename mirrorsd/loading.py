"""Building a :class:`~mirrorsd.model.Transformer` from weights: a local HF checkpoint folder in one of our weight
formats, an HF ``*ForCausalLM`` in memory, or an HF config and a state dict.

Why apart from :mod:`mirrorsd.model`: reading files, quantizing and translating HF configs have nothing to do with
running the network. The public entry points stay :meth:`Transformer.from_pretrained`,
:meth:`Transformer.from_hf` and :meth:`Transformer.from_state`, which delegate here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from . import weight_cache
from .linear import release_freed_heap
from .model import ModelConfig, Transformer, Weights
from .quant import quantize_q8
from .tuned_drafts import merge

#: Weight formats :meth:`Transformer.from_pretrained` can load (``--weights`` on the CLI).
WEIGHT_FORMATS = ("fp32", "q8", "q4")


def _is_projection(name: str) -> bool:
    return name == "lm_head.weight" or name.endswith("_proj.weight")


def from_pretrained(cls: type[Transformer], path: str | Path, device: str | torch.device, dtype: torch.dtype,
                    weights: str, linear: str, activations: str,
                    deltas: dict[str, torch.Tensor] | None = None) -> Transformer:
    """:meth:`Transformer.from_pretrained` (see there) for ``cls``."""
    model = _load(cls, path, device, dtype, weights, linear, deltas or {}).use_activations(activations)
    release_freed_heap()  # the checkpoint's tensors, converted and dropped
    return model


def _merged(state: dict, deltas: dict[str, torch.Tensor]) -> dict:
    """``state`` with a tuned draft's deltas added (:mod:`mirrorsd.tuned_drafts`)."""
    missing = sorted(set(deltas) - set(state))
    if missing:
        raise ValueError(f"the tuned draft's deltas name weights this model lacks: {missing[:2]}")
    return {k: merge(v, deltas[k]) if k in deltas else v for k, v in state.items()}


def _load(cls: type[Transformer], path: str | Path, device: str | torch.device, dtype: torch.dtype, weights: str,
          linear: str, deltas: dict[str, torch.Tensor]) -> Transformer:
    from safetensors import SafetensorError, safe_open
    from transformers import AutoConfig

    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    path = Path(path)
    if weights != "fp32" and (torch.device(device).type != "cpu" or dtype != torch.float32):
        raise ValueError(f"weights={weights!r} runs on CPU in fp32 only; use weights='fp32' on {device}")
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    ModelConfig.from_hf(hf_config)  # (an architecture we cannot run is refused before its weights are read)
    if weights == "q4":
        from .gguf_weights import load_gguf_weights

        gguf = path / "model.gguf"
        if not gguf.exists():
            raise FileNotFoundError(f"weights='q4' needs the original GGUF file at {gguf}")
        kept = None if deltas else weight_cache.file_for(gguf, linear)
        state = None if kept is None else weight_cache.load(kept)
        if state is not None:
            return from_state(cls, hf_config, state, linear)
        state = {k.removeprefix("model."): v for k, v in load_gguf_weights(gguf, hf_config).items()}
        model = from_state(cls, hf_config, _merged(state, deltas), linear)
        if kept is not None:
            del state  # the decoded codes, before the file is written
            release_freed_heap()
            weight_cache.store(kept, model, gguf)
        return model
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(path.glob("*.safetensors"))]
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            with safe_open(path / name, framework="pt", device=str(device)) as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    state[key.removeprefix("model.")] = f.get_tensor(key).to(dtype)
        except (OSError, SafetensorError) as error:  # (a cut-short download or copy: a traceback before)
            raise ValueError(f"{path / name} cannot be read ({error}): the file is incomplete or damaged; copy it "
                             f"again (a zoo model: delete {path} and run `mirrorsd models prepare NAME`)") from None
    state = _merged(state, deltas)
    if weights == "q8":
        if hf_config.tie_word_embeddings:  # (untied without its head: refused by the model, as for fp32)
            state["lm_head.weight"] = state["embed_tokens.weight"]
        state = {k: quantize_q8(v) if _is_projection(k) else v for k, v in state.items()}
    return from_state(cls, hf_config, state, linear).to(device)


def from_hf(cls: type[Transformer], hf_model: nn.Module, linear: str) -> Transformer:
    """:meth:`Transformer.from_hf` (see there) for ``cls``."""
    state = {k.removeprefix("model."): v.detach() for k, v in hf_model.state_dict().items()}
    return from_state(cls, hf_model.config, state, linear)


def from_state(cls: type[Transformer], hf_config, state: Weights, linear: str) -> Transformer:
    """:meth:`Transformer.from_state` (see there) for ``cls``: the config's shape and rotary frequencies (HF's
    rope-scaling variants included), then the weights."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = ModelConfig.from_hf(hf_config)
    rope = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
        scale = 1.0
    else:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return cls(cfg, state, inv_freq, scale, linear)
