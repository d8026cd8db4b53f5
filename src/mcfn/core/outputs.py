"""What a training step returns: named loss terms, scalar metrics and histograms, all tensors.

The shell sums ``losses`` and backpropagates the total, reads ``metrics`` back after the step (in one
transfer), and hands ``histograms`` to the logger. Nothing is read on the host inside the step.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

HIST_BINS, HIST_RANGE = 32, 4.0  # every histogram: counts in 32 equal bins over [-4, 4]


class StepOutput(NamedTuple):
    losses: dict[str, Tensor]  # "loss_*": 0-d terms; the caller sums and backpropagates them
    metrics: dict[str, Tensor]  # 0-d, under their logged names ("mc/...", "train/...")
    histograms: dict[str, Tensor]  # "hist/*": [HIST_BINS] counts over [-HIST_RANGE, HIST_RANGE]

    def total(self) -> Tensor:
        return sum(self.losses.values())

    def merge(self, other: StepOutput) -> StepOutput:
        return StepOutput(
            {**self.losses, **other.losses}, {**self.metrics, **other.metrics}, {**self.histograms, **other.histograms}
        )
