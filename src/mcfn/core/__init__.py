"""The pure, compiled core: the models (``model``, ``gistnet``, ``lensnet`` on its ``units``, ``reconstruction``), the
tree and its cuts (``nodes``, ``tree``, ``variants``, ``context``, ``allocator``), choosing a cut (``stream_view``,
``focus``, ``match``, ``cadence``, ``branches``, ``edits``, ``policy``: the one registry of focus policies), the
training step (``system`` with ``process_batch``, ``losses``, ``preferences``, ``attention``, ``teacher``,
``outputs``, ``weights``, ``step``), the benchmark's phase hook (``timing_hook``) and the model's FLOPs (``flops``).

No I/O, no host syncs. It imports nothing of mcfn's but itself and the base modules (``config``, ``typecheck``,
``geometry``, ``errors``); never the checkpoint file or the profiles (``pyproject.toml``'s contracts)."""

import einops
import torch

# Dynamo traces einops' pattern parser at every call (its cache does not hold under tracing): two thirds of the
# bytecode it traced for the refocus's choice. Let into the graph whole, each call is one node, which AOTAutograd
# expands with the cache at work (the choice's two graphs traced in 17.6 s before, 4.1-5.5 s after, with the
# layout's level sizes as fields).
for _op in (einops.rearrange, einops.reduce, einops.repeat, einops.einsum, einops.pack, einops.unpack):
    torch.compiler.allow_in_graph(_op)
