"""Gradient accumulation over micro-batches, and the largest micro-batch that fits on the GPU.

A process's share of the global batch runs as ``local / micro`` micro-batches of one fixed shape (one
compiled graph). Each micro-batch's loss is scaled by its share of the rows, so the accumulated gradient
is the gradient of the mean over the process's rows, whatever the micro-batch size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mcfn.errors import RunAborted, UserError
from mcfn.step import total_loss


def forward_backward(
    train_step: Callable[[Tensor, int, slice], dict[str, Tensor]],
    window: Tensor,
    step: int,
    first_row: int,
    micro: int,
    autocast: Callable,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Backpropagate the mean loss over ``window``'s rows (rows ``first_row..`` of the global batch) in
    micro-batches of ``micro`` rows; returns the loss and the outputs, scalars averaged over micro-batches
    (anything else, such as histograms, from the last one)."""
    local = window.size(0)
    share = micro / local  # each micro-batch's part of the mean over the rows
    loss_sum: Tensor | float = 0.0
    outs: dict[str, Tensor] = {}
    for lo in range(0, local, micro):
        # Compiled with CUDA graphs, a step's outputs live in buffers the next replay overwrites: mark each
        # micro-batch as a new step, and keep only fresh tensors (sums, clones) from it.
        torch.compiler.cudagraph_mark_step_begin()
        with autocast():
            out = train_step(window[lo : lo + micro], step, slice(first_row + lo, first_row + lo + micro))
        loss = total_loss(out) * share
        loss.backward()
        loss_sum = loss_sum + loss.detach()
        for k, v in out.items():
            v = v.detach()
            if v.ndim == 0:  # scalars: the mean over micro-batches
                outs[k] = outs.get(k, 0.0) + v * share
            else:  # histograms and the like: the last micro-batch's, copied out of graph-owned memory
                outs[k] = v.clone()
    assert isinstance(loss_sum, Tensor)  # at least one micro-batch ran
    return loss_sum, outs


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
