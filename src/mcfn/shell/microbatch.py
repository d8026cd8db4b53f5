"""The micro-batch size: a configured one checked, or the largest that fits on the GPU; and what to do when a
step runs out of memory. The accumulation itself is :meth:`mcfn.shell.trainer.Trainer.forward_backward`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mcfn.errors import RunAborted, UserError


def check_micro_batch(micro: int, local: int) -> int:
    if micro <= 0 or local % micro:
        raise UserError(f"train.micro_batch_size={micro} must divide this process's batch of {local} rows")
    return micro


def fitting_micro_batch(try_step: Callable[[int], None], local: int) -> int:
    """The largest divisor of ``local`` (halving from ``local``) for which ``try_step(micro)`` runs without
    running out of GPU memory."""
    micro = local
    while True:
        try:
            try_step(micro)
            return micro
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            if micro == 1 or micro % 2:
                raise RunAborted(
                    f"out of GPU memory even at micro-batch {micro}: use a smaller model or data.seq_len, or "
                    f"mc.budget / mc.variants (the packed rows per sample)"
                ) from None
            micro //= 2


def out_of_memory_message(micro: int) -> str:
    smaller = max(1, micro // 2)
    return (
        f"out of GPU memory at micro-batch {micro}; try --set train.micro_batch_size={smaller} (gradients "
        f"accumulate, so the global batch stays train.batch_size)"
    )
