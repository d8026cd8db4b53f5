"""Inference at growing lengths: the streaming tree (``streaming``), a refocus's choice as one fixed-shape graph
compiled once per capacity (``choice``), the KV cache and the token step, compiled with ``--compile`` (``decode``),
the one decode loop (``generation``), MC's refocuses and refills or full context's cache (``contexts``) and ASCII
pictures of working contexts (``render``).

It imports the core and the base modules; the evaluation, the benchmarks and the shell import it, never the reverse
(``pyproject.toml``'s contracts)."""
