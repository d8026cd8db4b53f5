"""Data parallelism under ``torchrun``: gloo on CPU, NCCL on GPU, no wrapper around the model.

Every rank holds the whole model and takes its share of each global batch (batch ``i`` is the same
``[B, T + 1]`` windows whatever the world size; rank ``r`` trains on rows ``r·B/P .. (r+1)·B/P``). After
the backward pass one all-reduce averages every gradient, together with the loss and the stop flag, so
all ranks take the same optimizer step and stop at the same step. Only rank 0 logs, evaluates and
writes checkpoints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from mcfn.errors import UserError


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def rows(self, batch_size: int) -> slice:
        """This rank's rows of a global batch."""
        if batch_size % self.size:
            raise UserError(f"train.batch_size={batch_size} must be a multiple of the {self.size} processes")
        per = batch_size // self.size
        return slice(self.rank * per, (self.rank + 1) * per)


def init_world(device_type: str) -> World:
    """The process group torchrun describes in the environment; a world of one without torchrun."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    world = World(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return world


def shutdown(world: World) -> None:
    if world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def average_gradients(params: list[torch.nn.Parameter], loss: Tensor, stop: bool, world: World) -> tuple[Tensor, bool]:
    """All-reduce the gradients (averaged), the loss (averaged) and the stop flag (any rank) in one call;
    returns the mean loss and whether any rank was asked to stop."""
    if world.size == 1:
        return loss, stop
    grads = [p.grad for p in params if p.grad is not None]
    extras = torch.stack([loss.detach().float(), torch.tensor(float(stop), device=loss.device)])
    flat = torch.cat([g.flatten().float() for g in grads] + [extras])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g) / world.size)
        offset += g.numel()
    return flat[-2] / world.size, bool(flat[-1] > 0)
