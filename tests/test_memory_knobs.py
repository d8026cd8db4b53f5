"""The memory knobs: activation checkpointing recomputes instead of storing and changes no number, and the CUDA
memory history is refused off CUDA and written once, after its steps."""

from __future__ import annotations

import torch
from builders import STEP_WEIGHTS, VOCAB, decisive, make_system
from compile_check import assert_one_graph_equals_eager

from mcfn.core.model import set_activation_checkpointing
from mcfn.core.system import process_batch
from mcfn.core.variants import draw_variant_noise
from mcfn.shell.memory import MemoryHistory
from mcfn.tools.benchmark import saved_activation_bytes
from train.run import main


def step_inputs(system, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, VOCAB, (2, system.layout.T + 1), generator=g)
    return window, draw_variant_noise(system.layout, 2, g, torch.device("cpu"))


def saved_bytes_and_grads(system, window, noise, step=process_batch) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes autograd keeps for the backward of one MC step (the benchmark's measure), and the gradients."""
    saved, out = saved_activation_bytes(lambda: step(system, window, noise, STEP_WEIGHTS))
    system.zero_grad(set_to_none=True)
    out.total().backward()
    return saved, {n: p.grad.clone() for n, p in system.named_parameters() if p.grad is not None}


def test_activation_checkpointing_keeps_less_and_gives_the_same_gradients():
    system = decisive(make_system(T=64, K=4, L=2, W=32, H=8, N=2, n_embd=32)).train()
    window, noise = step_inputs(system)
    stored, grads = saved_bytes_and_grads(system, window, noise)
    set_activation_checkpointing(system, True)
    assert all(b.checkpointed for b in system.base.blocks) and all(b.checkpointed for b in system.lensnet.blocks)
    recomputed, grads_ckpt = saved_bytes_and_grads(system, window, noise)
    assert recomputed < 0.8 * stored, (recomputed, stored)
    assert grads.keys() == grads_ckpt.keys() and len(grads) > 0
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_checkpointed_step_compiles_to_one_graph_and_equals_eager(fresh_dynamo):
    system = decisive(make_system(T=32, K=4, L=2, W=16, H=8, N=2)).train()
    set_activation_checkpointing(system, True)
    batches = [(system, *step_inputs(system, seed), STEP_WEIGHTS) for seed in range(3)]
    assert_one_graph_equals_eager(process_batch, batches, loss=lambda out: out.total(), params=system.parameters())


def test_a_memory_snapshot_off_cuda_is_refused_before_anything_runs(tmp_path, profile, capsys):
    assert main(["--profile", str(profile), "--out", str(tmp_path / "run"), "--memory-snapshot", "mem.pickle"]) == 2
    assert "CUDA" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_the_memory_history_is_written_once_after_its_steps(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    history = MemoryHistory(tmp_path / "sub" / "mem.pickle", steps=2)
    assert calls[0][0] == "record" and calls[0][1]["max_entries"] > 0
    assert history.step_done() is None and len(calls) == 1
    assert "mem.pickle" in history.step_done()
    assert calls[1] == ("dump", str(tmp_path / "sub" / "mem.pickle")) and calls[2] == ("record", {"enabled": None})
    assert history.step_done() is None and history.close() is None and len(calls) == 3
    silent = MemoryHistory(None, steps=1)
    assert silent.step_done() is None and silent.close() is None and len(calls) == 3


def test_a_run_shorter_than_the_snapshot_writes_it_at_the_end(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append("record"))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append("dump"))
    history = MemoryHistory(tmp_path / "mem.pickle", steps=5)
    history.step_done()
    assert history.close() is not None and calls == ["record", "dump", "record"]
