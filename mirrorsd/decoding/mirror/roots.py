"""Which early-exit candidates the draft rolls out: all of them (the paper), or the ones a calibrated scorer rates
most likely to be the correction, as many as the overlap budget Δ fits."""

from __future__ import annotations

from collections.abc import Sequence

from .channel import ChannelMessage, ExitTopK


def select_roots(msg: ChannelMessage, window: list[int], mode: str, scorer: RootScorer | None = None,
                 budget: int = 0) -> list[tuple[int, int]]:
    """Roots ``(position j, candidate v)`` to roll out: ``paper``, all ``(w+1)·κ`` top-κ candidates;
    ``budget``, the ``budget`` roots the scorer rates most likely to be this step's correction."""
    if mode == "paper":
        return [(j, v) for j in range(len(msg.ids)) for v in msg.row(j)]
    assert scorer is not None
    return scorer.select(msg, window, budget)


class DeviceRoots(Sequence[tuple[int, int]]):
    """The paper's roots, every early-exit candidate, with their token ids still on the device: root r continues
    candidate ``ids[r]`` at window position ``at[r]``. A rollout takes ``ids`` as they are; the pairs are read on
    the host only when asked for (which branch a verdict keeps)."""

    def __init__(self, top: ExitTopK) -> None:
        rows, kappa = top.ids.shape
        self.at = [j for j in range(rows) for _ in range(kappa)]
        self.ids = top.ids.reshape(-1)
        self._pairs: list[tuple[int, int]] | None = None

    def __len__(self) -> int:
        return len(self.at)

    def __getitem__(self, index):  # noqa: ANN001, ANN204 - Sequence's int and slice forms
        if self._pairs is None:
            self.read(self.ids.tolist())
        return self._pairs[index]

    def read(self, ids: list[int]) -> None:
        """The ids, as read on the host (with other values, in one read)."""
        self._pairs = list(zip(self.at, ids, strict=True))


class RootScorer:
    """The ``budget`` estimator: P(root (j, v) is the correction) = P(A = j) · P(c = v | A = j), both read off
    the early-exit candidates and calibrated on the generation's own past steps.

    * P(A = j) = Π_{i<j} a(d_{i+1}) · (1 − a(d_{j+1})), without the last factor at j = w (the bonus slot); a(d)
      is the observed acceptance rate of draft tokens that are (or are not) the early exit's top candidate at
      their position.
    * P(c = v | A = j) is the observed frequency of corrections at v's early-exit rank among the candidates
      that can be corrections (:meth:`ChannelMessage.candidates`); the last bin counts "none of them".

    Mid-layer probabilities are not taken at face value: the logit lens at N/2 is badly calibrated. Multiplying
    them along the window put the chance of reaching the bonus slot far below what the Qwen pair showed (its
    code windows were mostly accepted whole), so every root went to the first positions and none hit.
    """

    def __init__(self, kappa: int) -> None:
        self.accepts = {True: [3.0, 1.0], False: [1.0, 3.0]}  # agrees with the exit's top-1 -> [accepted, rejected]
        self.ranks = [0.5**r for r in range(kappa)] + [0.5**kappa]  # pseudo-counts per rank, last = not a candidate

    def acceptance(self, msg: ChannelMessage, window: list[int], j: int) -> float:
        accepted, rejected = self.accepts[window[j] == msg.ids[j][0]]
        return accepted / (accepted + rejected)

    def select(self, msg: ChannelMessage, window: list[int], budget: int) -> list[tuple[int, int]]:
        total = sum(self.ranks)
        scored: list[tuple[float, int, int, int]] = []
        reach = 1.0
        for j in range(len(msg.ids)):
            stop = 1.0 - self.acceptance(msg, window, j) if j < len(window) else 1.0
            for rank, v in enumerate(msg.candidates(window, j)):
                scored.append((-reach * stop * self.ranks[rank] / total, j, rank, v))
            if j < len(window):
                reach *= self.acceptance(msg, window, j)
        scored.sort()
        return [(j, v) for _, j, _, v in scored[:budget]]

    def observe(self, msg: ChannelMessage, window: list[int], accepted: int, correction: int) -> None:
        for j in range(min(accepted + 1, len(window))):
            self.accepts[window[j] == msg.ids[j][0]][0 if j < accepted else 1] += 1
        candidates = msg.candidates(window, accepted)
        rank = candidates.index(correction) if correction in candidates else len(self.ranks) - 1
        self.ranks[rank] += 1


class RootBudget:
    """Picks how many roots fit in the overlap budget Δ: fits draft-step time ≈ α + β·R by least squares
    over recent rollouts (proportional to R until two widths were seen) and takes the largest R whose γ
    steps stay within the recent median Δ."""

    def __init__(self, start: int, most: int, window: int = 32) -> None:
        self.current, self.most, self.window = start, most, window
        self.samples: list[tuple[int, float]] = []  # (roots, seconds per draft step)
        self.deltas: list[float] = []

    def observe(self, roots: int, steps: int, draft_s: float, delta_s: float) -> None:
        self.samples = [*self.samples, (roots, draft_s / max(steps, 1))][-self.window:]
        self.deltas = [*self.deltas, delta_s][-self.window:]
        widths = [r for r, _ in self.samples]
        per_step = [t for _, t in self.samples]
        if len(set(widths)) >= 2:
            beta, alpha = _line_fit(widths, per_step)
            beta = max(beta, 1e-9)
        else:
            alpha, beta = 0.0, sum(per_step) / sum(widths)
        delta = sorted(self.deltas)[len(self.deltas) // 2]
        fit = int((delta / max(steps, 1) - alpha) / beta)
        self.current = max(1, min(self.most, fit))


def _line_fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return slope, my - slope * mx
