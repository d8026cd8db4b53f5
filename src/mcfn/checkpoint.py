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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mcfn.config import RunConfig
from mcfn.errors import UserError
from mcfn.profile import config_from_saved

MAGIC = b"mcfn-checkpoint v1 "
CHECKPOINT_NAME = "checkpoint.pt"
# The layout of a run's state and its saved config. 2: the retired knobs (mc.lens.rank*, mc.lens.granularity,
# mc.variant_spend_min) and the readers of pre-[mc]-split configs are gone. 3: mc.teacher.distill_weight is gone.
# 4: every attention head has a learned gain (attn.gain).
CHECKPOINT_FORMAT = 4


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


@dataclass(frozen=True)
class Checkpoint:
    """A training run's checkpoint, read and verified, of this mcfn's format: what resume, ``--init-from``,
    evaluation, generation and ``--reference`` read, with the one compatibility check they all apply."""

    path: Path  # the file
    cfg: RunConfig  # the config the run was trained with
    step: int
    corpus_key: str  # the corpus and tokenizer it was trained on
    state: dict[str, Any]  # model, optimizers, rng and data_position, as :func:`run_state` wrote them

    @classmethod
    def read(cls, path: Path) -> Checkpoint:
        """``path``'s checkpoint (a run directory or the file), refused in one line when another version of
        mcfn wrote it."""
        file = run_checkpoint(path)
        state = load_checkpoint(file)
        if (found := state.get("format")) != CHECKPOINT_FORMAT:
            raise UserError(
                f"checkpoint {file} has format {found}; this mcfn reads format {CHECKPOINT_FORMAT} only: train it "
                "again, or read it with the mcfn version that wrote it"
            )
        return cls(file, config_from_saved(state["config"]), int(state["step"]), state.get("corpus_key", ""), state)

    def check_fits(
        self,
        role: str,
        corpus_key: str,
        cfg: RunConfig | None = None,
        same: tuple[str, ...] = (),
        than: str = "this run",
    ) -> None:
        """Refuse, in one line naming ``role`` (``--resume``, ``--init-from``, ...), a checkpoint trained on
        another corpus or tokenizer, or with another value of any config key in ``same`` (a section such as
        ``"model"``, or one key such as ``"data.seq_len"``) than ``cfg``."""
        if self.corpus_key != corpus_key:
            raise UserError(f"{role} {self.path} was trained on a different corpus or tokenizer than {than}")
        saved = self.cfg.flat()
        for key, value in (cfg.flat() if cfg is not None else {}).items():
            if any(key == name or key.startswith(f"{name}.") for name in same) and saved.get(key) != value:
                raise UserError(
                    f"{role} {self.path} was trained with {key}={saved.get(key)!r}, {than} has {value!r}: "
                    f"they must agree on {', '.join(f'[{name}]' if '.' not in name else name for name in same)}"
                )


def run_state(
    step: int, model: nn.Module, optimizers: list[torch.optim.Optimizer], cfg: RunConfig, corpus_key: str
) -> dict[str, Any]:
    """What a checkpoint of a run at ``step`` holds (the layout :class:`Checkpoint` reads)."""
    return {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "data_position": step,  # batch index of the next step: the sampler is a function of it
        "model": model.state_dict(),
        "optimizers": [opt.state_dict() for opt in optimizers],
        "rng": {"torch": torch.get_rng_state()},
        "config": cfg.to_dict(),
        "corpus_key": corpus_key,
    }
