"""Gradient accumulation over micro-batches, and the largest micro-batch that fits on the GPU.

A process's share of the global batch runs as ``local / micro`` micro-batches of one fixed shape (one
compiled graph). Each micro-batch's loss is scaled by its share of the rows, so the accumulated gradient
is the gradient of the mean over the process's rows, whatever the micro-batch size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mcfn.core.outputs import StepOutput
from mcfn.errors import RunAborted, UserError


def forward_backward(
    train_step: Callable[[Tensor, int, slice], StepOutput],
    window: Tensor,
    step: int,
    first_row: int,
    micro: int,
    autocast: Callable,
) -> tuple[Tensor, StepOutput]:
    """Backpropagate the mean loss over ``window``'s rows (rows ``first_row..`` of the global batch) in
    micro-batches of ``micro`` rows; returns the loss and the step's output, detached: loss terms and
    metrics averaged over micro-batches, histograms from the last one."""
    local = window.size(0)
    share = micro / local  # each micro-batch's part of the mean over the rows
    loss_sum: Tensor | float = 0.0
    scalars: list[dict[str, Tensor]] = []
    for lo in range(0, local, micro):
        # Compiled with CUDA graphs, a step's outputs live in buffers the next replay overwrites: mark each
        # micro-batch as a new step, and keep only fresh tensors (sums, clones) from it.
        torch.compiler.cudagraph_mark_step_begin()
        with autocast():
            out = train_step(window[lo : lo + micro], step, slice(first_row + lo, first_row + lo + micro))
        loss = out.total() * share
        loss.backward()
        loss_sum = loss_sum + loss.detach()
        scalars.append({k: v.detach() * share for k, v in (*out.losses.items(), *out.metrics.items())})
    assert isinstance(loss_sum, Tensor)  # at least one micro-batch ran
    mean = {k: sum(part[k] for part in scalars) for k in scalars[0]}
    histograms = {k: v.detach().clone() for k, v in out.histograms.items()}
    return loss_sum, StepOutput({k: mean[k] for k in out.losses}, {k: mean[k] for k in out.metrics}, histograms)


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
