"""The EAGLE-3-style draft head: its architecture, shared by training (:mod:`mirrorsd.train_eagle`) and drafting,
and its files.

The head is one decoder layer that drafts from the target's hidden states instead of re-reading the text: the
states entering the target's blocks 2, N/2 and N - 3 (low, middle, high, as EAGLE-3 takes them) are fused by
``fc3`` into one feature g_t; ``fc`` joins it with the embedding of the next token; the layer and a norm then give a
state whose LM-head logits predict the token after that. Drafting further feeds the head's own output state back in
place of g (EAGLE-3's training-time test). The embedding and the LM head are the target's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...files import save_tensors, write_text
from ...model import Transformer, _rotate_half

HEAD_CONFIG, HEAD_WEIGHTS = "eagle_head.json", "eagle_head.safetensors"


def feature_layers(n_layers: int) -> tuple[int, int, int]:
    """The blocks whose *input* states the head reads: EAGLE-3's low, middle and high (2, N // 2, N - 3), in order
    (a model of under 6 layers repeats one)."""
    low, middle, high = sorted((min(2, n_layers), n_layers // 2, max(0, n_layers - 3)))
    return low, middle, high


# -- the head -------------------------------------------------------------------------------------------------


def _dense(linear: nn.Module, bias: bool, device: torch.device,
           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A (possibly quantized) linear's weight ``[out, in]`` and bias, read off by applying it to the identity (each
    row has one non-zero, so int8-activation kernels read it exactly) in the target's ``dtype`` (its inputs')."""
    eye = torch.eye(linear.in_features, device=device, dtype=dtype)
    zero = linear(torch.zeros(1, linear.in_features, device=device, dtype=dtype)).float()[0]
    return (linear(eye).float() - zero).T.contiguous(), zero if bias else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = x.float()
    return (weight.float() * y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def check_target(target: Transformer) -> None:
    """A head's block is decoded as one of the target's (:class:`~.runtime.HeadRunner`), which reads q/k norms
    where the target has them; the head has none."""
    if target.config.qk_norm:
        raise ValueError("an EAGLE head has no q/k norms, which this target's blocks have (Qwen3): heads are "
                         "built for targets without them (Qwen2.5, Llama)")


class EagleHead(nn.Module):
    """fc3 fuses the three feature layers; fc joins the normed token embedding and the normed feature (EAGLE-1's
    join: the layer stays an ordinary decoder block, the one our kernels run); one block; a final norm. The LM
    head and the embedding are the target's, frozen and held outside."""

    def __init__(self, target: Transformer, init_from_target: bool = True) -> None:
        super().__init__()
        cfg = target.config
        check_target(target)
        h, self.eps = cfg.hidden_size, cfg.rms_norm_eps
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.fc3 = nn.Linear(3 * h, h, bias=False)
        self.fc = nn.Linear(2 * h, h, bias=False)
        with torch.no_grad():  # start as "the high feature, plus a little of the token": training moves it
            self.fc3.weight.zero_()
            self.fc3.weight[:, 2 * h:] = torch.eye(h)
            self.fc.weight.normal_(0, 0.02 / math.sqrt(h))
            self.fc.weight[:, h:] += torch.eye(h)
        self.norm_e, self.norm_h, self.norm = (nn.Parameter(torch.ones(h)) for _ in range(3))
        self.input_norm, self.post_norm = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
        kv = cfg.n_kv_heads * cfg.head_dim
        shapes = {"q_proj": (cfg.n_heads * cfg.head_dim, h), "k_proj": (kv, h), "v_proj": (kv, h),
                  "o_proj": (h, cfg.n_heads * cfg.head_dim), "gate_proj": (cfg.intermediate_size, h),
                  "up_proj": (cfg.intermediate_size, h), "down_proj": (h, cfg.intermediate_size)}
        self.proj = nn.ModuleDict({name: nn.Linear(i, o, bias=cfg.qkv_bias and name in ("q_proj", "k_proj", "v_proj"))
                                   for name, (o, i) in shapes.items()})
        if init_from_target:  # the target's last block: sensible scales for a layer that reads its states
            last = target.layers[-1]
            sources = {**{n: getattr(last.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
                       **{n: getattr(last.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")}}
            with torch.no_grad():
                for name, linear in sources.items():
                    weight, bias = _dense(linear, self.proj[name].bias is not None, target.device, target.dtype)
                    self.proj[name].weight.copy_(weight)
                    if bias is not None:
                        self.proj[name].bias.copy_(bias)
                self.input_norm.copy_(last.input_layernorm.weight.float())
                self.post_norm.copy_(last.post_attention_layernorm.weight.float())
                self.norm.copy_(target.norm.weight.float())

    def join(self, embedded: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """The block's input from a token's embedding and the state it drafts from (fused target features or the
        head's own previous output)."""
        joined = [rms_norm(embedded, self.norm_e, self.eps), rms_norm(feature, self.norm_h, self.eps)]
        return self.fc(torch.cat(joined, -1))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = x.shape[0]
        y = rms_norm(x, self.input_norm, self.eps)
        q = self.proj["q_proj"](y).view(t, self.n_heads, self.head_dim).transpose(0, 1)
        k = self.proj["k_proj"](y).view(t, self.n_kv_heads, self.head_dim).transpose(0, 1)
        v = self.proj["v_proj"](y).view(t, self.n_kv_heads, self.head_dim).transpose(0, 1)
        return rotary(q, cos, sin), rotary(k, cos, sin), v

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of the block after attention: its output state (pre-norm, what the next step feeds back)."""
        x = x + self.proj["o_proj"](attended.transpose(0, 1).reshape(x.shape[0], -1))
        y = rms_norm(x, self.post_norm, self.eps)
        return x + self.proj["down_proj"](F.silu(self.proj["gate_proj"](y)) * self.proj["up_proj"](y))


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The model's rotary embedding (its eager path), in ``x``'s dtype (bf16 under autocast in training)."""
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


@dataclass
class HeadConfig:
    """What loads a trained head: its base, the feature layers it reads and the training recipe."""

    base: str
    feature_layers: tuple[int, int, int]
    hidden_size: int
    n_layers: int
    depth: int
    recipe: dict

    def save(self, folder: Path, head: EagleHead) -> None:
        """The weights, then the config, each whole."""
        folder.mkdir(parents=True, exist_ok=True)
        save_tensors({k: v.detach().float().contiguous() for k, v in head.state_dict().items()}, folder / HEAD_WEIGHTS)
        write_text(folder / HEAD_CONFIG, json.dumps(self.__dict__ | {"feature_layers": list(self.feature_layers)},
                                                    indent=1) + "\n")


def load_head(target: Transformer, source: str | Path | EagleHead) -> EagleHead:
    """A trained head (``mirrorsd train-eagle``'s folder) for ``target``; a head object passes through."""
    from safetensors.torch import load_file

    if isinstance(source, EagleHead):
        return source
    folder = Path(source)
    if not (folder / HEAD_CONFIG).is_file():
        raise FileNotFoundError(f"{folder} holds no {HEAD_CONFIG}: train a head with `mirrorsd train-eagle`")
    config = json.loads((folder / HEAD_CONFIG).read_text())
    cfg = target.config
    if (config["hidden_size"], config["n_layers"]) != (cfg.hidden_size, cfg.n_layers):
        raise ValueError(f"the head in {folder} was trained for {config['base']} ({config['n_layers']} layers of "
                         f"{config['hidden_size']}), not this target ({cfg.n_layers} of {cfg.hidden_size})")
    head = EagleHead(target, init_from_target=False)
    head.load_state_dict(load_file(str(folder / HEAD_WEIGHTS)))
    return head.eval()
