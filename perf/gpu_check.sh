#!/usr/bin/env bash
# The one GPU check: installs carried wheels, runs the GPU tests and the GPU benchmarks, and writes
# their JSON and logs into $OUT (default: perf/results/<date>-gpu). Meant for one call on a machine
# with no internet: missing packages (diffusers, transformers, ...) come as wheels in ./wheels/.
#
#   bash perf/gpu_check.sh                 # everything, about 8 minutes on an H200
#   FVGRAPH_GPU_QUICK=1 bash perf/gpu_check.sh   # tests + one benchmark shape
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-perf/results/$(date +%Y-%m-%d)-gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/fvgraph-inductor}"

site=/tmp/fvgraph-site
if compgen -G "wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" wheels/*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$site" . || exit 1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

run() {  # run NAME TIMEOUT_S COMMAND...: output to $OUT/NAME.log, keep going on failure
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "rc=$?" >>"$OUT/$name.log"
  tail -n 3 "$OUT/$name.log"
}

run env 60 python3 -m fvgraph env --json
run pytest_gpu 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests
if [ -n "${FVGRAPH_GPU_QUICK:-}" ]; then
  run bench_step 240 python3 perf/bench_step.py --gpu --shapes 256x256x17
else
  run bench_step 330 python3 perf/bench_step.py --gpu --shapes 480x832x33 256x256x17
  run bench_projection_cache 90 python3 perf/bench_projection_cache.py --gpu
fi
grep -h '^{' "$OUT"/bench_*.log >"$OUT/results.jsonl" 2>/dev/null
echo "results in $OUT"
