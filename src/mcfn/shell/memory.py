"""CUDA's memory history over a run's first steps (``train.run --memory-snapshot``), for PyTorch's memory viewer.

The snapshot is a pickle that https://pytorch.org/memory_viz (or ``torch.cuda._memory_viz``) draws: every
allocation with its stack, over time. It is recorded from the first step, compilation included, and written
after ``SNAPSHOT_STEPS`` steps, or when the run ends sooner.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mcfn.errors import UserError

MAX_ENTRIES = 200_000  # allocation events kept (the oldest are dropped first)
SNAPSHOT_STEPS = 3  # steps recorded: the first compiles, the next show the steady state


def check_memory_snapshot(path: str, device: torch.device) -> None:
    """Refuse a snapshot off CUDA before anything is set up: only CUDA's allocator keeps a history."""
    if path and device.type != "cuda":
        raise UserError(f"--memory-snapshot records CUDA's allocator, and this run is on {device}")


class MemoryHistory:
    """Records CUDA's allocation history from construction and writes it to ``path`` after ``steps`` calls of
    :meth:`step_done` (or at :meth:`close`). A ``None`` path records nothing."""

    def __init__(self, path: Path | None, steps: int):
        self.path, self.left = path, steps
        if self.path is not None:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)

    def step_done(self) -> str | None:
        """Count a step; after the last one, write the snapshot and say where."""
        self.left -= 1
        return self.close() if self.left == 0 else None

    def close(self) -> str | None:
        if self.path is None:
            return None
        path, self.path = self.path, None
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        return f"[run] CUDA memory history written to {path} (open it at https://pytorch.org/memory_viz)"
