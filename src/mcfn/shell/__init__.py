"""The imperative shell: devices, files and processes. The training loop (``trainer``, ``session``), optimizers,
checkpoints, metrics, data parallelism and micro-batches around the core's pure step; the run's end (``outcome``:
the ship choice, the final evaluation, ``summary.json``; ``run_report``, ``headline``: ``report.md``) and
``train.eval``'s work (``checkpoint_evaluation``).

It may import every package of mcfn; only ``train/`` imports it (``pyproject.toml``'s contracts)."""
