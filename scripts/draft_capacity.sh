#!/usr/bin/env bash
# The shared draft's capacity (BENCHMARKS.md, draft capacity): serve deployments/draft_capacity.yaml on this machine,
# run `s2d bench draft-capacity` against it (1, 2, 3 targets at rising concurrency), stop the app. It times things:
# run it on an otherwise idle machine.
#   scripts/draft_capacity.sh OUT_DIR [extra bench args, e.g. --concurrency 1,2,4]
# Run from the repository root; PYTHON (default .venv/bin/python) runs both; CONFIG (default
# deployments/draft_capacity.yaml) is the app served; the prompts are Spec-Bench's under S2D_DATA_DIR (or pass
# --questions PATH).
set -u
out=${1:?usage: scripts/draft_capacity.sh OUT_DIR [bench args]}
shift
py=${PYTHON:-.venv/bin/python}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
"$py" -m ray.serve.scripts run "${CONFIG:-deployments/draft_capacity.yaml}" > "$out.serve.log" 2>&1 &
serve_pid=$!
# SIGTERM: a background job of a script ignores SIGINT; serve run's local Ray goes with it
trap 'kill -TERM $serve_pid 2>/dev/null; wait $serve_pid' EXIT
for _ in $(seq 1 150); do
  curl -sf http://127.0.0.1:8000/health > /dev/null && break
  kill -0 $serve_pid 2>/dev/null || { echo "serve run exited; see $out.serve.log"; exit 1; }
  sleep 2
done
echo "load average before: $(cat /proc/loadavg)"
"$py" -m s2d_ray.cli bench draft-capacity --url http://127.0.0.1:8000 \
  --targets smollm2-135m-instruct,smollm2-135m-gsm8k,smollm2-135m-instruct-b --out "$out" "$@"
