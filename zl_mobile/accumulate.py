"""Gradient accumulation over an update window: the token-level mean.

A program's phase 2 (ZeroLock's local step, or a BP backward) returns the gradient of its
micro-batch's loss, which is a mean over that micro-batch's valid positions. The window's
gradient is the mean over all of the window's valid positions, as if the window were one
batch (what transformers' gradient accumulation does since 4.46): each micro-batch's gradient
is weighted by its number of valid positions, and the sum is divided by the window's total.
The mean of micro-batch means would weight a 1-position micro-batch like a 7-position one.
One rule for ZeroLock and the BP baselines (docs/PROTOCOL.md, "Update windows")."""
from __future__ import annotations

import torch


class WindowGradients:
    """Per-window sums of n_valid * grad and of n_valid; `mean(w)` takes the window's gradient."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self._params = params
        self._sums: dict[int, dict[str, torch.Tensor]] = {}
        self._positions: dict[int, float] = {}

    def add(self, window: int, grads: dict[str, torch.Tensor], n_valid: float) -> None:
        """`grads`: the gradient of the micro-batch's mean loss over its `n_valid` positions."""
        acc = self._sums.setdefault(window, {n: torch.zeros_like(t) for n, t in self._params.items()})
        if n_valid > 0:
            for n, g in grads.items():
                acc[n].add_(g, alpha=float(n_valid))
        self._positions[window] = self._positions.get(window, 0.0) + float(n_valid)

    def mean(self, window: int) -> dict[str, torch.Tensor]:
        """The window's token-level mean gradient (zeros for a window with no valid position)."""
        acc = self._sums.pop(window)
        total = max(self._positions.pop(window), 1.0)
        return {n: g / total for n, g in acc.items()}

    def positions(self, window: int) -> float:
        return self._positions.get(window, 0.0)
