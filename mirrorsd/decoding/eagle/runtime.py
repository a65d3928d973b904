"""The trained head as decoding runs it: its block as a one-layer :class:`~mirrorsd.model.Transformer` on our
kernels (int8 weights on a CPU, so a draft step reads ~1/20 of the 1.5B target's bytes; batched with other
requests' by the continuous batcher like any model), its input joins and its reduced-vocabulary LM head."""

from __future__ import annotations

import dataclasses

import torch

from ...draft_vocab import head_weight, load_table
from ...kv_cache import KVCache
from ...linear import make_linear
from ...model import RMSNorm, Transformer
from ...quant import quantize_q8
from .head import EagleHead


def _weight(w: torch.Tensor, target: Transformer) -> torch.Tensor:
    """int8 codes where our CPU kernels run (an fp32 model on a CPU), else the weight in the target's dtype."""
    w = w.detach().float()
    if target.device.type == "cpu" and target.dtype == torch.float32 and w.shape[1] % 32 == 0:
        return quantize_q8(w)
    return w.to(target.device, target.dtype)


class HeadRunner:
    """A head made ready for one target, shared by every request: ``new_cache`` for a request, ``rows`` to run."""

    def __init__(self, target: Transformer, head: EagleHead, vocab: int = 0, table: str = "corpus") -> None:
        cfg = target.config
        self.ids = load_table(cfg.vocab_size, table)[:vocab].sort().values if 0 < vocab < cfg.vocab_size else None
        rows = head_weight(target.lm_head, target.embed_tokens.weight, cfg.tie_word_embeddings).float()
        def vector(p: torch.Tensor) -> torch.Tensor:  # (in the target's dtype, as its projections: a bfloat16
            return p.detach().to(target.device, target.dtype)  # target's float32 norms failed its matmuls)

        weights = {"embed_tokens.weight": target.embed_tokens.weight, "norm.weight": vector(head.norm),
                   "lm_head.weight": _weight(rows if self.ids is None else rows[self.ids], target),
                   "layers.0.input_layernorm.weight": vector(head.input_norm),
                   "layers.0.post_attention_layernorm.weight": vector(head.post_norm)}
        for name, linear in head.proj.items():
            kind = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            weights[f"layers.0.{kind}.{name}.weight"] = _weight(linear.weight, target)
            if linear.bias is not None:
                weights[f"layers.0.{kind}.{name}.bias"] = vector(linear.bias)
        # One block of the target's shape; its LM head has the (reduced) vocabulary's rows, in ``ids`` order.
        self.model = Transformer(dataclasses.replace(cfg, n_layers=1, tie_word_embeddings=False), weights,
                                 target.inv_freq, target.rope_scale).eval()
        self.fc3 = make_linear(_weight(head.fc3.weight, target))
        self.fc = make_linear(_weight(head.fc.weight, target))
        # The model's own norm (the C++ one on its fused path): a row's bits must not depend on how many rows ran
        # with it, or a chain would depend on how the accepted rows were grouped into catch-ups.
        self.norm_e, self.norm_h = (RMSNorm(vector(w), head.eps) for w in (head.norm_e, head.norm_h))
        self.norm_e.fused = self.norm_h.fused = self.model.norm.fused

    def new_cache(self, capacity: int) -> KVCache:
        return self.model.new_cache(capacity=capacity)

    def rows(self, tokens: list[int], features: torch.Tensor, position: int, cache: KVCache, *,
             fed_back: bool) -> tuple[torch.Tensor, int]:
        """Run rows at ``position``, ``position + 1``... reading ``tokens`` and ``features``: the target's three
        states, or (``fed_back``) the head's own output states. Returns the last row's output state and the token
        it drafts."""
        model = self.model
        ids = torch.tensor(tokens, device=model.device)
        g = features if fed_back else self.fc3(features)
        x = self.fc(torch.cat([self.norm_e(model.embed(ids)), self.norm_h(g)], -1))
        positions = torch.arange(position, position + len(tokens), device=model.device)[None]
        state = model.run_layers(x[None], positions, cache)[0, -1:]
        column = int(model.logits(state)[0].argmax())
        return state, column if self.ids is None else int(self.ids[column])
