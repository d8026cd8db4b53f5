"""The pure, compiled core: the models, the MegaContext functions and the training step. No I/O, no host
syncs; imports nothing from the other packages of mcfn but the base modules (config, typecheck)."""
