"""``mirror``: Mirror Speculative Decoding (Bhendawade et al. 2025, arXiv 2510.13161), per-position reading.

One step, with committed text ending in ``a`` (the target cache holds everything before it) and the current
draft window ``d_1..d_w``:

1. **Prefix** -- the target runs layers ``[0, ℓe)`` on ``[a, d_1..d_w]``.
2. **Early exit** -- the target's own final norm + LM head on those hidden states; the top-κ ids and log-probs
   at each of the ``w+1`` positions form the token-channel message. Only ids and log-probs cross, never logits.
3. **Rollouts, in parallel** (an :mod:`~mirrorsd.runtime` executor) -- while the target runs ``[ℓe, N)``, the
   draft rolls out, for every root ``(j, v)``, a γ-token continuation of ``(committed, a, d_1..d_j, v)``. All
   roots go through the draft together, one tree-masked forward per draft step over the shared prefix cache.
4. **Verification** -- the loop's verifier (match or rejection): ``A`` tokens accepted and the target's own
   token ``c`` at slot ``A+1`` (correction, or bonus after full acceptance).
5. **Reuse or fallback** -- hit iff the root ``(A, c)`` was rolled out (in ``paper`` mode, iff ``c`` is among
   the top-κ early-exit candidates of position ``A``): its rollout is the next window at once and the draft
   cache is compacted to that branch. Miss: the next window is a fresh rollout from ``(committed, c)``, whose
   time is exposed.

On the loop, steps 1-3 are :class:`~.target.EarlyExitScorer` and step 5 is :class:`~.draft.BranchProposer`'s
feedback. Every
committed token is the target's own, so the output equals ``ar``; the branch rolled out for ``(A, c)`` is exactly
the window vanilla SD's draft would propose after that step (same context, same position-keyed noise), so the
accepted lengths equal ``sd``'s with the same draft and ``confidence`` (the paper's parity claim, App. B).

The package, one module per part: :mod:`.options`; :mod:`.channel` (the message and the early exit); :mod:`.roots`
(which candidates roll out); :mod:`.draft` (the draft side: the branch proposer over a local draft);
:mod:`.remote` (the draft in its own process); :mod:`.target` (the scorer); :mod:`.stats`; :mod:`.method` (the
roles, the cost model and the registration).
"""

from .channel import ChannelMessage, early_exit
from .draft import Tree
from .method import build
from .options import DEFAULT_EXIT, DEFAULT_KAPPA, MirrorOptions, resolve_exit_layer
from .roots import RootBudget, RootScorer, select_roots

__all__ = ["DEFAULT_EXIT", "DEFAULT_KAPPA", "ChannelMessage", "MirrorOptions", "RootBudget", "RootScorer", "Tree",
           "build", "early_exit", "resolve_exit_layer", "select_roots"]
