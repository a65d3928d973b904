"""Tuned early exits: an affine translator per layer in front of the target's own final norm + LM head.

Mirror-SD's early exit is the *logit lens*: the target's final norm and LM head applied to the layer-ℓe state
(the paper's choice). On the middle layers of small models that state is far from the final one, so the
target's correction is rarely among the exit's top-κ and Mirror-SD falls back to fresh rollouts. A *tuned lens*
(Belrose et al. 2023) first maps the layer-ℓ state to an estimate of the final state; fitted in closed form by
least squares (Din et al. 2023, "Jump to Conclusions"), it is one d×d matmul per row, next to a d×vocab head.

The translator works on unit-RMS states (RMSNorm ignores scale, and Qwen's few huge residual features would
otherwise dominate the fit): ``exit(h) = head(norm([h / rms(h), 1] @ A))`` with ``A`` of shape ``[d + 1, d]``.
Exactness does not depend on it: the exit only chooses which branches the draft rolls out.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from .errors import OptionError
from .files import save_tensors, write_text

if TYPE_CHECKING:
    from .model import Transformer

CONFIG_FILE = "exit_head.json"
WEIGHTS_FILE = "exit_head.safetensors"
SHIPPED = Path(__file__).parent / "data" / "exit_heads"


def unit_rms(hidden: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)


@dataclass
class ExitTranslators:
    """Per-layer translators ``layer -> A [d + 1, d]`` (the last row is the bias), and how they were made."""

    layers: dict[int, torch.Tensor]
    meta: dict[str, Any]

    def __call__(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        """An estimate of the final layer's state (before the final norm) from a layer-``layer`` state."""
        a = self.layers[layer].to(hidden)  # no copy when device and dtype already match
        return unit_rms(hidden) @ a[:-1] + a[-1]

    def check(self, layer: int, hidden_size: int, n_layers: int | None = None,
              fix: str = "pick one of those exit layers or fit it with `mirrorsd train-exit --layers`") -> None:
        fitted = self.meta.get("n_layers")
        if n_layers is not None and fitted is not None and fitted != n_layers:  # (same width, another depth)
            raise ValueError(f"the tuned exit was fitted on a {fitted}-layer model, the target has {n_layers}: it "
                             "belongs to another model")
        if layer not in self.layers:
            raise ValueError(f"the tuned exit has translators for layers {sorted(self.layers)}, not layer {layer}; "
                             f"{fix}")
        if self.layers[layer].shape != (hidden_size + 1, hidden_size):
            raise ValueError(f"the tuned exit was fitted for hidden size {self.layers[layer].shape[1]}, the target "
                             f"has {hidden_size}: it belongs to another model")

    def merged_into(self, base: ExitTranslators) -> ExitTranslators:
        """``base`` with this fit's layers in place of its own: a refit of some layers (on other data, say) that
        keeps the rest. Each refitted layer's recipe and learning curve go under ``meta["refits"]``."""
        for layer, a in self.layers.items():
            for other in base.layers.values():
                if other.shape != a.shape:
                    raise ValueError(f"layer {layer}'s translator has shape {tuple(a.shape)}, the exit it would join "
                                     f"{tuple(other.shape)}: they belong to different models")
        meta = {**base.meta, "layers": sorted({*base.layers, *self.layers}),
                "held_out": {**base.meta.get("held_out", {}), **self.meta.get("held_out", {})},
                "refits": {**base.meta.get("refits", {}),
                           **{str(layer): {key: self.meta.get(key) for key in ("kind", "recipe", "curve", "fit_s")}
                              for layer in self.layers}}}
        return ExitTranslators({**base.layers, **self.layers}, meta)

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        # bf16 halves the shipped size; the fit is not precise to more than 3 digits anyway. Each file whole, the
        # config last (``--into`` rewrites an exit in place: a kill must not leave a truncated file; between the two
        # renames it leaves the new weights under the old config, which a rerun of the same command replaces)
        save_tensors({f"layer{i}": a.to(torch.bfloat16).contiguous() for i, a in self.layers.items()},
                     folder / WEIGHTS_FILE)
        write_text(folder / CONFIG_FILE, json.dumps(self.meta, indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> ExitTranslators:
        folder = Path(folder)
        if not (folder / CONFIG_FILE).is_file():
            raise ValueError(f"{folder} holds no tuned exit ({CONFIG_FILE} is missing); make one with "
                             "`mirrorsd train-exit`")
        tensors = load_file(str(folder / WEIGHTS_FILE))
        layers = {int(k.removeprefix("layer")): v.float() for k, v in tensors.items()}
        return cls(layers, json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8")))


def shipped_exit(model_name: str, layer: int | None = None) -> Path | None:
    """The tuned exit shipped in the package for a zoo model (one with a translator for ``layer``, if given)."""
    folder = SHIPPED / model_name
    if not (folder / CONFIG_FILE).is_file():
        return None
    if layer is not None and layer not in json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))["layers"]:
        return None
    return folder


def tuned_exit(target: Transformer, head: str, layer: int, option: str = "exit_head"
               ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The translator of ``layer`` from a tuned-exit folder (``option`` names the method option that gave it)."""
    if head == "tuned":
        raise OptionError(option, "tuned needs the target's zoo name to find its shipped exit (the API resolves "
                          "it); pass the folder from `mirrorsd train-exit` instead")
    translators = ExitTranslators.load(head)
    if option == "prune_exit":  # the layer is fixed by the adapter's N_s, and the zoo ships N/4, N/2, 3N/4 only
        translators.check(layer, target.config.hidden_size, target.config.n_layers,
                          f"ss prunes at layer N - N_s = {layer}: fit one with `mirrorsd train-exit --layers {layer}` "
                          "and pass prune_exit=FOLDER (--prune-exit FOLDER)")
    else:
        translators.check(layer, target.config.hidden_size, target.config.n_layers)
    return partial(translators, layer=layer)


def layer_or_fraction(text: str) -> int | float:
    """An int when it is one (a layer index), else a float (a fraction of the depth)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


layer_or_fraction.kind = "a layer index or a fraction"  # type: ignore[attr-defined]


def resolve_exit_layer(exit_layer: int | float, n_layers: int) -> int:
    """A layer of an ``n_layers``-deep model to exit at: an index in ``1..N-1``, or a fraction of the depth in (0, 1)
    (``0.5`` is Mirror-SD's N/2). Mirror-SD's exit and the tuned exits trained for it read it alike."""
    if isinstance(exit_layer, float) and not exit_layer.is_integer():
        if not 0 < exit_layer < 1:
            raise OptionError("exit_layer", f"as a fraction must be in (0, 1), got {exit_layer}")
        index = round(exit_layer * n_layers)
    else:
        index = int(exit_layer)
    if not 1 <= index <= n_layers - 1:
        given = f"{exit_layer} of {n_layers} layers is layer {index}" if index != exit_layer else f"got {exit_layer}"
        raise OptionError("exit_layer", f"must be in 1..{n_layers - 1} for a {n_layers}-layer target (or a fraction "
                          f"in (0, 1) that rounds to one), {given}")
    return index
