#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with torch and the project (editable, with the
# dev extra). On a machine without an NVIDIA GPU it installs torch's CPU build; a GPU machine keeps
# the CUDA torch it has (or gets the default CUDA build). Re-running it is cheap.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" "torch>=2.9"
  else
    # 2.13.0 is the release this project is tested on; where a local CPU wheel is configured
    # (pip find-links) pip takes it, and MCFN_TORCH_SPEC / PIP_INDEX_URL can point elsewhere.
    "${pip[@]}" "${MCFN_TORCH_SPEC:-torch==2.13.0}"
  fi
fi
"${pip[@]}" -e ".[dev]"
