"""The imperative shell: devices, files and processes. The training loop, optimizers, checkpoints, metrics,
data parallelism and micro-batches, around the core's pure step."""
