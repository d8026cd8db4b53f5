"""Quality evaluation: does the working context keep what matters? ``evaluate`` (the one entry point of ``train.eval``,
a run's final evaluation, the ship choice and the stage's judge) on held-out windows (``held_out``, drawn one way) under
generation's protocol (``refocused``) and one cut (``one_cut``), the statistics with errors by document (``stats``), the
typed report (``result``), its tables and plots (``report``, ``plots``), the best-of headroom (``headroom``), the long-
range tokens (``long_range``), each policy's recall of the far blocks full attention reads (``indexer_recall``) and each
edit's measured ΔNLL (``counterfactual``, which ``utility_corr`` reads).

It imports the core, the data and inference below it; never the benchmarks (:mod:`mcfn.bench`), the focus stage
(:mod:`mcfn.stage`) or the shell (the import-linter contracts in ``pyproject.toml`` hold this)."""
