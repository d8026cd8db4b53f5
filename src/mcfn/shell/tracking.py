"""Metrics: one JSON object per logged step in ``metrics.jsonl``, mirrored to wandb (offline by default).

wandb never needs an account or a network here: ``offline`` writes under the run directory (sync it
later with ``wandb sync``), ``disabled`` skips it. On resume, records from the resumed step on are
dropped first, so a step that ran before the interruption is not logged twice.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mcfn.core.outputs import HIST_RANGE

METRICS_NAME = "metrics.jsonl"


def _parse(line: str) -> dict[str, Any] | None:
    """A record, or None for a blank line or the torn last line of a killed run."""
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


def _drop_records_from(path: Path, step: int) -> None:
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if (record := _parse(line)) and record["step"] < step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)


class MetricsLog:
    def __init__(
        self,
        out_dir: Path,
        config: dict[str, Any],
        wandb_mode: str,
        project: str,
        resume_step: int | None = None,
        enabled: bool = True,
    ):
        """``enabled=False`` (every rank but 0 of a distributed run) writes nothing at all."""
        self.path = out_dir / METRICS_NAME
        self._file = self._wandb = None
        if not enabled:
            return
        if resume_step is not None:
            _drop_records_from(self.path, resume_step)
        self._file = self.path.open("a")
        if wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            id_file = out_dir / "wandb_id"
            run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
            id_file.write_text(run_id)
            self._histogram = wandb.Histogram
            self._wandb = wandb.init(
                project=project,
                mode=wandb_mode,
                dir=str(out_dir),
                config=config,
                id=run_id,
                resume="allow",
                name=out_dir.name,
            )

    def log(self, record: dict[str, Any], histograms: dict[str, torch.Tensor] | None = None) -> None:
        """One record to ``metrics.jsonl`` and wandb; histograms (``hist/*``: counts over fixed bins from
        ``mcfn.core.preferences``) go to wandb only."""
        if self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is None:
            return
        payload = {k: v for k, v in record.items() if k != "step"}
        for name, counts in (histograms or {}).items():
            edges = np.linspace(-HIST_RANGE, HIST_RANGE, counts.numel() + 1)
            payload[name] = self._histogram(np_histogram=(counts.detach().cpu().numpy(), edges))
        self._wandb.log(payload, step=record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(out_dir: Path) -> list[dict[str, Any]]:
    path = out_dir / METRICS_NAME
    return [record for line in path.read_text().splitlines() if (record := _parse(line))]
