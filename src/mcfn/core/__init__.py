"""The pure, compiled core: the models (``model``, ``gistnet``, ``lensnet`` on its ``units``, ``reconstruction``), the
tree and its cuts (``nodes``, ``tree``, ``variants``, ``context``, ``allocator``), choosing a cut (``stream_view``,
``focus``, ``match``, ``cadence``, ``branches``, ``edits``, ``policy``: the one registry of focus policies), the
training step (``system`` with ``process_batch``, ``losses``, ``preferences``, ``attention``, ``teacher``,
``outputs``, ``weights``, ``step``), the benchmark's phase hook (``timing_hook``) and the model's FLOPs (``flops``).

No I/O, no host syncs. It imports nothing of mcfn's but itself and the base modules (``config``, ``typecheck``,
``geometry``, ``errors``); never the checkpoint file or the profiles (``pyproject.toml``'s contracts)."""
