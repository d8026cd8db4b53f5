#!/usr/bin/env bash
# Every GPU measurement in one call, each step under its own time cap: scripts/gpu_check.sh [--dry] [--out DIR] ...
# The steps, their caps and what they record are in train/gpu_check.py; --dry runs them on the CPU at tiny shapes.
#
# Python: the project's .venv where there is one, else python3 (a lent GPU machine's, which has torch). Packages
# that machine lacks travel as wheels in .whl/ (the device tool's README says how to fetch them); they are
# installed into a private folder, never into the system.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import tensordict, beartype, jaxtyping, einops" 2>/dev/null; then
  if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "error: $PY lacks the project's packages and there is no .whl/ to install them from" >&2
    exit 2
  fi
  site=${TMPDIR:-/tmp}/mcfn-site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site:$PYTHONPATH"
fi
args=("$@")
has_out=0
for a in "$@"; do [ "$a" = "--out" ] && has_out=1; done
[ $has_out = 1 ] || args+=(--out "${OUT:-runs/gpu-check}")
exec "$PY" -m train.gpu_check "${args[@]}"
