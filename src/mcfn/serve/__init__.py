"""Serving a trained run over HTTP: the OpenAI completions protocol (``protocol``), one decode at a time on a worker
thread through generation's one decode loop (``worker``), the FastAPI app with the page that shows where the model
looks (``app``, ``static/``). ``train.serve`` loads the run and starts it under uvicorn.

It imports the core, the data and inference below it; never the shell, the stage or the evaluation (the
import-linter contracts in ``pyproject.toml``)."""
