"""DEL's per-request statistics and choices (Zheng et al., 2025, sections 4.1-4.4).

Each round, every candidate exit layer l gets a "shadow token" at each valid
position of the round (the token layer l would have drafted there) and its
confidence. With S(a) = sum_i w^(r-i-1) a[i], a sum decayed by w per round:

    alpha_l = S(c_l) / S(u)                       matched share of valid positions
    TPL(l, d) = sum_{i<=d} alpha_l^i / (d*(l+o) + L + o)   tokens per loaded layer
    tau_l = (S(tcs_l)/S(c_l) + S(fcs_l)/S(u - c_l)) / 2

u: valid positions of the round, c_l: those where layer l's shadow token equals
the token that followed, tcs_l / fcs_l: summed confidence of matched /
mismatched shadow tokens, o: a forward's fixed cost (LM head, sampling,
engine) in layers; the paper counts layers only (o = 0). The next round
drafts with the (E, gamma) that maximises TPL; a draft stops when its
confidence at E falls below tau_E.
A mean with no observations yet counts as 0 in tau (no mismatches seen: any
confidence above half the matched mean may draft).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def tokens_per_layer(
    acceptance: np.ndarray, exit_layers: np.ndarray, num_layers: int, max_length: int,
    step_overhead: float = 0.0,
) -> np.ndarray:
    """TPL[l, d] for each candidate layer and speculation length d = 0..max_length."""
    lengths = np.arange(max_length + 1)
    powers = acceptance[:, None] ** np.arange(max_length + 1)[None, :]
    expected_tokens = np.cumsum(powers, axis=1)  # sum_{i<=d} alpha^i, exact at alpha=1
    draft_step = exit_layers[:, None] + step_overhead
    loaded_layers = lengths[None, :] * draft_step + num_layers + step_overhead
    return expected_tokens / loaded_layers


@dataclass
class ExitChoice:
    """One request's drafting plan for the next round."""

    exit_index: int  # index into the candidate exit layers
    exit_layer: int
    max_drafts: int  # 0: do not draft this round
    threshold: float  # stop a draft whose confidence at the exit is below this
    acceptance: float  # alpha of the chosen layer


@dataclass
class ExitStats:
    """Decayed sums of one request, one entry per candidate exit layer."""

    exit_layers: np.ndarray
    decay: float
    valid: float = 0.0  # S(u)
    matched: np.ndarray = field(default=None)  # S(c_l)
    matched_confidence: np.ndarray = field(default=None)  # S(tcs_l)
    mismatched_confidence: np.ndarray = field(default=None)  # S(fcs_l)

    def __post_init__(self) -> None:
        zeros = np.zeros(len(self.exit_layers))
        for name in ("matched", "matched_confidence", "mismatched_confidence"):
            if getattr(self, name) is None:
                setattr(self, name, zeros.copy())

    def update(
        self,
        valid: float,
        matched: np.ndarray,
        matched_confidence: np.ndarray,
        mismatched_confidence: np.ndarray,
    ) -> None:
        """Add one round: S <- w*S + a_r."""
        w = self.decay
        self.valid = w * self.valid + valid
        self.matched = w * self.matched + matched
        self.matched_confidence = w * self.matched_confidence + matched_confidence
        self.mismatched_confidence = w * self.mismatched_confidence + mismatched_confidence

    def acceptance(self) -> np.ndarray:
        if self.valid <= 0:
            return np.zeros(len(self.exit_layers))
        return np.clip(self.matched / self.valid, 0.0, 1.0)

    def thresholds(self) -> np.ndarray:
        mismatched = self.valid - self.matched
        matched_mean = np.divide(self.matched_confidence, self.matched,
                                 out=np.zeros_like(self.matched), where=self.matched > 0)
        mismatched_mean = np.divide(self.mismatched_confidence, mismatched,
                                    out=np.zeros_like(mismatched), where=mismatched > 0)
        return (matched_mean + mismatched_mean) / 2

    def choose(
        self,
        num_layers: int,
        max_length: int,
        fixed_exit_layer: int | None = None,
        fixed_length: int | None = None,
        step_overhead: float = 0.0,
    ) -> ExitChoice:
        """argmax TPL(l, d); a fixed layer or length restricts the search to it
        (a fixed length also turns the confidence threshold off: static drafting)."""
        tpl = tokens_per_layer(self.acceptance(), self.exit_layers, num_layers, max_length,
                               step_overhead)
        if fixed_exit_layer is not None:
            keep = self.exit_layers == fixed_exit_layer
            tpl = np.where(keep[:, None], tpl, -1.0)
        if fixed_length is not None:
            keep = np.arange(max_length + 1) == min(fixed_length, max_length)
            tpl = np.where(keep[None, :], tpl, -1.0)
        # Ties (d = 0 is worth 1/L at every layer) go to the deepest layer.
        best = np.flatnonzero(tpl == tpl.max())[-1]
        index, length = (int(i) for i in np.unravel_index(best, tpl.shape))
        if fixed_length is None and length > 0:
            # Within the round the confidence threshold sets the length (up to
            # max_length, as DEL's Algorithm 1); TPL decides whether drafting pays.
            length = max_length
        return ExitChoice(
            exit_index=int(index),
            exit_layer=int(self.exit_layers[index]),
            max_drafts=length,
            threshold=0.0 if fixed_length is not None else float(self.thresholds()[index]),
            acceptance=float(self.acceptance()[index]),
        )
