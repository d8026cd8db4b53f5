"""torch.compile's portable cache ("mega-cache") kept beside the token cache, so that a run starts warm even
where torch's own cache directory (``TORCHINDUCTOR_CACHE_DIR``, under ``/tmp`` by default) has been wiped.

At start the run hot-loads the artifacts a previous run of the same configuration saved; after every step
that compiled something new it saves them again (the FX graph, AOT autograd, autotuning and, on GPU, Triton
caches in one file). torch checks versions and devices itself: a stale file only misses.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
import torch._dynamo.utils

from mcfn.config import RunConfig


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def artifacts_path(cfg: RunConfig, corpus_dir: Path, device: torch.device) -> Path:
    """One file per configuration of what gets compiled (model, MegaContext, batch, mode), torch and device."""
    what = {
        "model": cfg.to_dict()["model"],
        "mc": cfg.to_dict()["mc"],
        "batch": [cfg.train.batch_size, cfg.train.micro_batch_size, cfg.train.plain_steps > 0],
        "mode": cfg.train.compile_mode,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        # The ATen kernels in force (ATEN_CPU_CAPABILITY): a CPU kernel compiled under AVX2 and loaded by a process
        # at AVX-512 corrupted the heap (free(): invalid next size; LABLOG, twentieth session).
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    return corpus_dir / f"compile-{digest}.bin"


class CompileCache:
    """Loads the saved artifacts once, and saves them again whenever a step has compiled new graphs."""

    def __init__(self, path: Path):
        self.path, self.saved_at = path, compiled_graphs()

    def load(self) -> str | None:
        if not self.path.is_file():
            return None
        torch.compiler.load_cache_artifacts(self.path.read_bytes())
        return f"[run] compile cache loaded from {self.path}"

    def save_if_new(self) -> None:
        graphs = compiled_graphs()
        if graphs == self.saved_at:
            return
        self.saved_at = graphs
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            return
        part = self.path.with_suffix(f".{os.getpid()}.part")  # written whole, then renamed: never half a file
        part.write_bytes(artifacts[0])
        part.replace(self.path)
