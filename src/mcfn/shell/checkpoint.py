"""Checkpoints: one file, written atomically, verified by a checksum before it is trusted.

File layout: a header line ``mcfn-checkpoint v1 <sha256 of payload>\\n`` followed by the payload, a
``torch.save`` of the state dict. It is written to a temporary file in the same directory, flushed to
disk, then renamed over the old one: a crash at any moment leaves either the old or the new checkpoint,
never a mix, and a truncated or altered file fails its checksum on load.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from mcfn.errors import UserError

MAGIC = b"mcfn-checkpoint v1 "
CHECKPOINT_NAME = "checkpoint.pt"
# The layout of a run's state and its saved config. 2: the retired knobs (mc.lens.rank*, mc.lens.granularity,
# mc.variant_spend_min) and the readers of pre-[mc]-split configs are gone.
CHECKPOINT_FORMAT = 2


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    header = MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n"
    for stale in path.parent.glob(f".{path.name}.*"):  # left by a process killed mid-write
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_checkpoint(path: Path) -> Path:
    """The checkpoint file of ``path``: a run directory (its ``checkpoint.pt``) or the file itself."""
    return path / CHECKPOINT_NAME if path.is_dir() else path


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read and verify a checkpoint; any problem is a UserError naming the file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"no checkpoint at {path}") from None
    except OSError as e:
        raise UserError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    header, sep, payload = data.partition(b"\n")
    if not header.startswith(MAGIC) or not sep:
        raise UserError(f"checkpoint {path} is not an mcfn checkpoint (bad header)")
    if hashlib.sha256(payload).hexdigest().encode() != header[len(MAGIC) :]:
        raise UserError(f"checkpoint {path} is corrupt (checksum mismatch: truncated or altered)")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing to the user
        raise UserError(f"checkpoint {path} cannot be loaded: {e}") from None
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise UserError(f"checkpoint {path} lacks model or step")
    return state


def load_run_state(path: Path) -> dict[str, Any]:
    """A training run's checkpoint (resume, ``--init-from``, evaluation, generation), refused in one line when
    another version of mcfn wrote it."""
    state = load_checkpoint(path)
    if (found := state.get("format")) != CHECKPOINT_FORMAT:
        raise UserError(
            f"checkpoint {path} has format {found}; this mcfn reads format {CHECKPOINT_FORMAT} only: train it "
            "again, or read it with the mcfn version that wrote it"
        )
    return state
