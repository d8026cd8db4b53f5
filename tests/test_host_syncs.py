"""Host syncs per training step: the update reads nothing back from the device, and a logged step reads its metrics
back in a fixed, small number of transfers (issue 68: on a GPU each read-back stalls the host until the device's
queue drains, and the launches after it wait).

No CPU test can see a CUDA sync, so this counts what causes one: a Python read of a tensor's value (``item``,
``tolist``, ``bool``, ``float``, ``int``, ``numpy``, ``cpu``), seen through a ``TorchFunctionMode`` around the
trainer's steps. The optimizers' learning rates are host tensors on every device (0-d CPU tensors, read as floats by
design): reads of those are not syncs and are not counted."""

from __future__ import annotations

import pytest
from builders import tiny_sections, write_profile
from torch.overrides import TorchFunctionMode

from mcfn.shell import trainer as trainer_module
from train.run import main

READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu", "__format__"}


class ReadCounter(TorchFunctionMode):
    """Counts Python reads of tensor values, except of the tensors in ``host`` (by identity)."""

    def __init__(self, host: set[int]):
        super().__init__()
        self.host, self.reads = host, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS and args and id(args[0]) not in self.host:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mc", [True, False])
def test_an_update_reads_nothing_back_and_a_logged_step_reads_its_metrics_once(tmp_path, text_dir, monkeypatch, mc):
    """Every step's update (data, forward and backward, clipping, the non-finite check, both optimizers) makes no
    read of a device tensor; a logged step's record and its skipped-update count make two (one each). Fails with
    the per-step ``bool(isfinite(loss))`` the update had before."""
    log_every, steps = 3, 7
    profile = write_profile(
        tmp_path / "p.toml",
        tiny_sections(f"text:{text_dir}", train={"log_every": log_every, "eval_every": 1000, "final_eval_batches": 0}),
    )
    per_step: dict[str, list[int]] = {"update": [], "record": []}
    real_step, real_record, real_skips = (
        trainer_module.Trainer.optimizer_step,
        trainer_module.Trainer.step_record,
        trainer_module.Trainer.account_skips,
    )

    def host_tensors(trainer) -> set[int]:
        return {id(g["lr"]) for opt in trainer.s.optimizers for g in opt.param_groups}

    def counted(real, key):
        def wrapper(self, *args):
            with ReadCounter(host_tensors(self)) as counter:
                out = real(self, *args)
            if key == "update":
                per_step["update"].append(len(counter.reads))
            else:  # the record and the skip count of one logged step add up
                per_step["record"].append(len(counter.reads))
            return out

        return wrapper

    monkeypatch.setattr(trainer_module.Trainer, "optimizer_step", counted(real_step, "update"))
    monkeypatch.setattr(trainer_module.Trainer, "step_record", counted(real_record, "record"))
    monkeypatch.setattr(trainer_module.Trainer, "account_skips", counted(real_skips, "record"))
    args = ["--profile", str(profile), "--out", str(tmp_path / "run"), "--steps", str(steps)]
    assert main(args + ([] if mc else ["--no-mc"])) == 0
    assert per_step["update"] == [0] * steps
    logged = len([s for s in range(steps) if s % log_every == 0 or s == steps - 1])
    assert per_step["record"] == [1, 1] * logged  # account_skips, then step_record
