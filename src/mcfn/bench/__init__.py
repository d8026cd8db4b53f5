"""Speed measurement: the training step and its phases (``benchmark``, on ``timing``'s timer and rig), the T sweep
(``sweep``), decoding (``decode_speed``, with the operators a refocus launches: ``operators``) and LensNet's forward
(``lens``); the model's FLOPs are the core's (:mod:`mcfn.core.flops`). ``train.bench`` and ``train.gpu_check`` drive
them.

It imports the core and inference below it; never the quality evaluation (:mod:`mcfn.evaluation`: ``train.bench``
hands the benchmark what it times of it), the focus stage or the shell (``pyproject.toml``'s contracts)."""
