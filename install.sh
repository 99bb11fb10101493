#!/usr/bin/env bash
# Fresh-machine install: a venv in .venv with pinned CPU torch and everything else in ONE resolver step (so pip never
# pulls a CUDA torch), then DeepSpeed built against it with its shared-memory all-reduce op compiled up front.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q -r requirements.txt
if ! .venv/bin/python -c "import deepspeed" 2>/dev/null; then
  DS_BUILD_SHM_COMM=1 DS_ACCELERATOR=cpu .venv/bin/python -m pip install -q --no-build-isolation --no-cache-dir \
    deepspeed==0.19.8
fi
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
echo "installed: $(.venv/bin/python -c 'import torch, transformers, ray, deepspeed; print("torch", torch.__version__, "transformers", transformers.__version__, "ray", ray.__version__, "deepspeed", deepspeed.__version__)' 2>/dev/null)"
