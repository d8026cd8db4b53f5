"""Data: document sources (``sources``), the BPE tokenizer (``tokenizer``), the pre-tokenized token cache and its
splits (``corpus``), window sampling and the evaluation's windows (``loader``), the long-range tasks (``probes``) and
the training sampler that mixes them into the text (``mixture``).

It imports the base modules only (``config``, ``seeding``, ``errors``); the core never imports it, nor it the core
(``pyproject.toml``'s contracts)."""
