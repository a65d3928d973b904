"""Mirror-SD's options: the window, the early exit, the roots, the backend, and the shipped files they default to."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

from ...exit_heads import layer_or_fraction, resolve_exit_layer
from ...runtime import BACKENDS
from ..drafting import acceptance_option, draft_streams_option, draft_vocab_option, streams_flag
from ..lookup import suffix_match_option
from ..registry import MethodOptions, ModelShape, OptionError, ShippedFiles, at_least, option, probability

DEFAULT_GAMMA = 7  # the paper's window
DEFAULT_KAPPA = 8  # the paper's top-κ at batch size 1
DEFAULT_EXIT = 0.5  # ℓe = N/2
ROOT_MODES = ("paper", "budget")
# App. D.1: as the batch grows the draft's κ·γ expansion stops hiding under the target, so κ and the draft's SS stream
# count come down ("κ = 8 with two SS streams for B ∈ {1, 8}; from B = 16 onward we use a single SS stream";
# 8/2 → 4/1 → 2/1 → 1/1). Rows: (largest batch, κ cap, stream cap); None: the options' own.
BATCH_SCHEDULE = ((8, None, None), (16, 4, 1), (63, 2, 1))
LARGE_BATCH = (1, 1)
CANDIDATE_SOURCES = ("exit", "draft")
# Draft rows a step's branch rollouts may run (the paper's γ = 7, κ = 8: 64 roots of 7 tokens, 448 rows), as ss caps
# its whole tree: every root's logits and attention rows are held at once (κ = 49152 asked ~77 GB of logits).
MAX_ROLLOUT_ROWS = 4096


def batch_caps(batch: int) -> tuple[int | None, int | None]:
    """The paper's (κ cap, SS stream cap) for a batch of ``batch`` requests sharing each forward."""
    for most, kappa, streams in BATCH_SCHEDULE:
        if batch <= most:
            return kappa, streams
    return LARGE_BATCH


def thread_split(text: str) -> tuple[int, int]:
    target, draft = (int(x) for x in text.split(","))
    return target, draft


thread_split.kind = "TARGET,DRAFT thread counts"  # type: ignore[attr-defined]


@dataclass(frozen=True)
class MirrorOptions(MethodOptions):
    gamma: int = option(DEFAULT_GAMMA, "most draft tokens per verification window", check=at_least(1))
    kappa: int = option(DEFAULT_KAPPA, "top-κ early-exit candidates per window position", check=at_least(1))
    exit_layer: int | float = option(DEFAULT_EXIT, "early-exit layer ℓe: an index 1..N-1 or a fraction of the "
                                     "target's depth", parse=layer_or_fraction, check=(lambda v: v > 0, "must be > 0"))
    candidates: str = option("exit", "where a window position's κ candidate corrections come from: exit (the "
                             "target's early-exit top-κ, the paper) or draft (the draft's own next κ likeliest tokens "
                             "at the positions it drafted, the exit's at the bonus slot)", choices=CANDIDATE_SOURCES)
    roots: str = option("budget", "budget: roll out only the candidates most likely to be the correction, as many "
                        "as fit in the time of the target's upper layers (none on the serial backend, where nothing "
                        "overlaps: every rollout there is time the step waits for); paper: all (γ+1)·κ of them, as "
                        "the paper does",
                        choices=ROOT_MODES)  # Spec-Bench, serial: 0.87x ar (no roots), 0.66x (one), 0.17x (paper)
    budget: int | None = option(None, "with --roots budget: a fixed number of roots instead of fitting Δ (on the "
                                "serial backend: roll out that many although nothing overlaps)", parse=int,
                                check=at_least(1), default_text="fit Δ")
    backend: str = option("serial", "where the draft runs while the target finishes: serial (no overlap, the "
                          "reference), threads (CPU core split), cuda-streams (one GPU), devices (--draft-device), "
                          "processes (the draft in its own process, a torch.distributed token channel)",
                          choices=BACKENDS)
    overlap_graphs: str = option("off", "with --backend cuda-streams or devices: on keeps CUDA graphs on while the "
                                 "draft's rollouts overlap the target's upper layers; off (until a GPU has validated "
                                 "it) runs both sides eagerly there: a capture on one thread was once invalidated by "
                                 "the other's work, and captures now run one at a time, thread-locally, on the "
                                 "model's own capture stream", choices=("off", "on"))
    draft_issue: str = option("thread", "with --backend cuda-streams: who issues the draft's rollouts onto the second "
                              "stream: thread (a worker thread, while the target's thread issues its upper layers) "
                              "or inline (the target's thread, right after its upper layers: no GIL contention, "
                              "CUDA graphs on both sides; the default once a GPU has validated it)",
                              choices=("thread", "inline"))
    channel_timeout: float = option(60.0, "with --backend processes: seconds to wait for the draft process before "
                                    "going on without it", check=(lambda v: v > 0, "must be > 0"))
    threads: tuple[int, int] | None = option(None, "with --backend threads: TARGET,DRAFT intra-op threads while "
                                             "they overlap", default_text="the larger half to the target",
                                             parse=thread_split, check=(lambda v: len(v) == 2 and min(v) >= 1,
                                                                        "must be two positive counts"))
    acceptance: str = acceptance_option()
    confidence: float = option(0.6, "end a draft window at the first position where the draft's top probability "
                               "is below this; 0 always drafts γ tokens (the paper)",
                               check=probability())  # Spec-Bench, serial: 1.10x ar vs 0.92x at 0 (docs/mirror_sd.md)
    draft_streams: Any = draft_streams_option()
    exit_vocab: int | None = option(None, "score the early exit on the N most frequent token ids only (the "
                                    "correction is rarely outside them, and 32k of 152k ids read a fifth of the "
                                    "head); 0: the full vocabulary, as the paper", parse=int, check=at_least(0),
                                    default_text="32768 where a frequency table ships")
    exit_head: str = option("auto", "early-exit head: lens (the target's final norm + LM head on the layer-ℓe "
                            "state: the paper's choice), tuned (an affine translator per layer first, fitted by "
                            "`mirrorsd train-exit`: the target's shipped one, or give its folder), or auto (the "
                            "shipped tuned exit where the target has one for ℓe, else the lens)", parse=str,
                            metavar="HEAD")
    suffix_match: int = suffix_match_option()
    draft_vocab: int | None = draft_vocab_option(None)  # measured: 0.69x ar vs 0.62x full (docs/drafting.md)

    def __post_init__(self) -> None:
        object.__setattr__(self, "draft_streams", streams_flag(self.draft_streams))

    def check(self, shape: ModelShape | None) -> None:
        if self.budget is not None and self.roots != "budget":
            raise OptionError("budget", "takes a number of roots with roots='budget'")
        if self.overlap_graphs == "on" and self.backend not in ("cuda-streams", "devices"):
            raise OptionError("overlap_graphs", "applies to backend='cuda-streams' or 'devices'")
        if self.draft_issue == "inline" and self.backend != "cuda-streams":
            raise OptionError("draft_issue", "applies to backend='cuda-streams'")
        if self.draft_issue == "inline" and self.overlap_graphs == "on":
            raise OptionError("overlap_graphs", "applies to a draft issued from a thread (draft_issue='thread'); "
                              "inline keeps graphs as the target has them")
        if self.threads is not None and self.backend not in ("threads", "devices", "processes"):
            raise OptionError("threads", "applies to backend='threads' (or 'devices', 'processes')")
        if self.candidates == "draft" and self.draft_streams is not None:
            raise OptionError("candidates", "draft reads an AR draft's logits; use candidates='exit' with "
                              "draft_streams")
        if self.backend == "processes" and self.acceptance == "rejection":
            raise OptionError("acceptance", "rejection needs the draft's distributions; backend='processes' carries "
                              "token ids only (use acceptance='match')")
        if isinstance(self.exit_layer, float) and not self.exit_layer.is_integer() and not 0 < self.exit_layer < 1:
            raise OptionError("exit_layer", f"as a fraction must be in (0, 1), got {self.exit_layer}")
        if self.rollout_rows() > MAX_ROLLOUT_ROWS:
            fixed = self.roots == "budget" and self.budget is not None  # (the budget sets the roots, not kappa)
            blamed, other = ("kappa", "gamma") if self.kappa > 1 and not fixed else ("gamma", "kappa")
            raise OptionError(blamed, f"{getattr(self, blamed)} with {other} {getattr(self, other)} rolls out "
                              f"{self.rollout_roots()} branches of {self.gamma} tokens in every step, "
                              f"{self.rollout_rows()} draft rows (at most {MAX_ROLLOUT_ROWS}: a step holds all their "
                              "logits and attention at once): give a smaller kappa, gamma or budget")
        if shape is not None:
            resolve_exit_layer(self.exit_layer, shape.n_layers)
            if self.kappa > shape.vocab_size:
                raise OptionError("kappa", f"must be in 1..{shape.vocab_size} (the vocabulary), got {self.kappa}")
        if self.backend == "serial" and self.roots == "budget" and self.budget is None:
            unused = [name for name, default in (("kappa", DEFAULT_KAPPA), ("candidates", "exit"),
                                                 ("exit_layer", DEFAULT_EXIT), ("exit_vocab", None))
                      if getattr(self, name) != default]
            if unused:
                warnings.warn("mirror: the serial backend rolls out no branch unless told (nothing overlaps there, "
                              f"so a rollout is never hidden), so these options change nothing: {', '.join(unused)}; "
                              "give budget=N or roots='paper', or an overlapping backend", UserWarning, stacklevel=2)

    def rollout_roots(self) -> int:
        """Most branches one step rolls out: every candidate root, (γ+1)·κ, or a fixed budget's fewer; none where
        the serial backend fits its budget (nothing overlaps there, so nothing rolls out)."""
        if self.backend == "serial" and self.roots == "budget" and self.budget is None:
            return 0
        every = (self.gamma + 1) * self.kappa
        return every if self.roots == "paper" or self.budget is None else min(self.budget, every)

    def rollout_rows(self) -> int:
        return self.rollout_roots() * self.gamma

    def resolved(self, files: ShippedFiles, shape: ModelShape) -> MirrorOptions:
        """``draft_streams`` alone: the draft's shipped adapter; ``exit_head="tuned"``: the target's shipped tuned
        exit; ``"auto"``: that exit where it has a translator for ℓe, else the lens. At N/2 on the Qwen pair the
        tuned exit's top-8 holds the correction almost three times as often as the lens's (0.28 against 0.10 on
        Spec-Bench, docs/mirror_sd.md), for one d×d matmul per window row."""
        opts = self
        if opts.draft_streams == "auto":
            opts = replace(opts, draft_streams=files.streams("draft"))
        if opts.exit_head == "tuned":
            opts = replace(opts, exit_head=files.tuned_exit("exit_head"))
        elif opts.exit_head == "auto":
            exit_layer = resolve_exit_layer(opts.exit_layer, shape.n_layers)
            opts = replace(opts, exit_head=files.exit_for_layer(exit_layer) or "lens")
        return opts

    def check_tensor_parallel(self, self_draft: bool = False) -> None:
        super().check_tensor_parallel(self_draft)
        # its blocks' all-reduces on two threads, paired at random (processes: the draft rank builds its own)
        if self_draft and self.backend not in ("serial", "processes"):
            raise ValueError(f"a self-draft shares the sharded target's blocks, whose all-reduces the {self.backend} "
                             "backend would run beside the target's on one group: use backend='serial' (--backend "
                             "serial)")
        if self.roots == "budget" and self.budget is None:
            raise ValueError("roots='budget' (the default) fits its root count to timings, which differ between "
                             "ranks; give a fixed budget (--budget N) or roots='paper' on a tensor-parallel target")

    def draft_ranks(self) -> bool:
        return self.backend == "processes"

    def check_draft_sharded(self) -> None:
        if not self.draft_ranks():
            super().check_draft_sharded()
        if self.draft_streams is not None:
            raise ValueError("--draft-tp shards the draft's projections, which its stream adapter cannot follow: "
                             "drop draft_streams")

    def unbatchable(self) -> str | None:
        if self.backend != "serial":
            return f"Mirror-SD's {self.backend} backend overlaps its draft with the target outside the batch"
        return None

    def priced_layers(self, n_layers: int) -> tuple[int, ...]:
        return (resolve_exit_layer(self.exit_layer, n_layers),)
