"""Seeds for the run's independent random streams, derived from the run seed and an index.

Every stream (training windows, variant noise, validation windows and noise) gets its own tag in the
high bits, so two generators never start from the same state: the variant noise of step ``i`` is not
the random stream that chose step ``i``'s windows. A seed depends only on ``(seed, stream, index)``,
which is what makes a resumed run replay exactly.
"""

from __future__ import annotations

STREAMS = {
    "train_windows": 1,
    "train_noise": 2,
    "val_windows": 3,
    "val_noise": 4,
    "eval_contexts": 5,
    "eval_probes": 6,
    "train_mix": 7,
    "lens_stage": 8,  # the LensNet stage: its initialisation (index 0) and each round's epoch order (index r)
    "lens_traces": 9,  # the LensNet stage: each round's random candidate cuts
    "label_halves": 10,  # the labels' reliability: which predictions each half of a chunk takes
    "needle": 11,  # the needle grid: each length's haystacks and keys (index: the length)
}


def derive_seed(seed: int, stream: str, index: int) -> int:
    return (STREAMS[stream] << 56) | ((seed * 1_000_003 + index) & ((1 << 56) - 1))
