#!/usr/bin/env bash
# The one GPU check: installs carried wheels, runs the GPU tests and the GPU benchmarks, and writes
# their JSON and logs into $OUT (default: perf/results/<date>-gpu). Meant for a machine with no
# internet: missing packages (diffusers, transformers, ...) come as wheels in ./wheels/ (docs/gpu.md).
#
# It comes in parts, each within one 600 s device call: every part's limits add up to at most 540 s,
# and each part's own estimate (docs/gpu.md: how each was reached) is below its limits. In order:
#   FVGRAPH_GPU_PART=probe       bash perf/gpu_check.sh  # the open questions first: TF32 probe, parity -O2 vs -O0, the inductor-step test that failed on the first H200 run (verbose); about 230 s on 2026-12-04
#   FVGRAPH_GPU_PART=coldstart   bash perf/gpu_check.sh  # bench_coldstart, Wan 1.3B config, bucket 1: a cold and a warm start with standalone artifacts (no AOTInductor runtime), phases printed; 120 s on an H100 (2026-12-05)
#   FVGRAPH_GPU_PART=tests       bash perf/gpu_check.sh  # env, test_gpu.py (but the capture cache), the CUDA kernels, the projection cache and adapters at -O3 on CUDA; est. 360 s
#   FVGRAPH_GPU_PART=tests_loops bash perf/gpu_check.sh  # the step-caching, TI2V, HTTP and HunyuanVideo-1.5 tests on CUDA; est. 450 s
#   FVGRAPH_GPU_PART=aoti        bash perf/gpu_check.sh  # the capture-cache test (AOTInductor packages on CUDA); 282 s on 2026-12-04 (the child load died of SIGSEGV)
#   FVGRAPH_GPU_PART=aoti_probe  bash perf/gpu_check.sh  # perf/aoti_load_probe.py: the packages the capture-cache test builds, loaded one way per child process (and under gdb); over 190 s on a fresh machine (2026-12-04)
#   FVGRAPH_GPU_PART=step        bash perf/gpu_check.sh  # bench_step at 480x832x33, batch 1, -O1/-O2/-O3 vs diffusers eager and regional compile; 263 s on an H100 (2026-12-05)
#   FVGRAPH_GPU_PART=serving     bash perf/gpu_check.sh  # bench_serving (buckets 1, 4) + scheduler overhead; est. 450 s
#   FVGRAPH_GPU_PART=kernels     bash perf/gpu_check.sh  # bench_kernels (Wan-1.3B / 14B kernel shapes); est. 300 s
#   FVGRAPH_GPU_PART=coldstart_b48 bash perf/gpu_check.sh  # bench_coldstart, buckets 4 and 8; est. 450 s
#   FVGRAPH_GPU_PART=cache       bash perf/gpu_check.sh  # bench_projection_cache; est. 120 s
#   FVGRAPH_GPU_PART=http        bash perf/gpu_check.sh  # bench_http: engine vs fvgraph serve --port at -O2, one round; est. 480 s
#   FVGRAPH_GPU_PART=interceptors bash perf/gpu_check.sh  # bench_interceptors: Wan 1.3B config, 480x832x17, 50 steps, -O2; est. 480 s
#   FVGRAPH_GPU_PART=parallel    bash perf/gpu_check.sh  # the parallel engine at degree 1 (NCCL group of one, -O2 CUDA graphs); est. 200 s
#   FVGRAPH_GPU_PART=lora        bash perf/gpu_check.sh  # bench_lora, batch 4, rank 32: no adapter row / all rows / one row vs no slots; est. 480 s
#   FVGRAPH_GPU_PART=lora_r128   bash perf/gpu_check.sh  # the same at rank 128; est. 480 s
#   FVGRAPH_GPU_PART=distilled   bash perf/gpu_check.sh  # bench_distilled: s per request, 4-step distilled vs 50-step CFG base, 480x832x81, -O1, one round; est. 450 s (2 compiles + 2 base requests)
#   FVGRAPH_GPU_PART=rollouts    bash perf/gpu_check.sh  # bench_rollouts: samples/s of engine.rollout K=8 vs a per-sample loop, 480x832x33, 10 CFG steps, -O2; est. 400 s (1 compile + 6 groups of 8)
#   FVGRAPH_GPU_PART=flux_step   bash perf/gpu_check.sh  # bench_step on FLUX.1-dev's config (seeded, bf16), 1024x1024, batch 1, -O1/-O2 vs diffusers eager and regional compile; est. 500 s (12B seeded init + 2 compiles)
#   FVGRAPH_GPU_PART=hv15_step   bash perf/gpu_check.sh  # bench_step on HunyuanVideo-1.5's 480p transformer (8.3B, seeded, bf16), 480x848x17, batch 1, -O1/-O2 vs diffusers eager and regional compile; est. 470 s (four 8.3B seeded inits + 2 compiles)
#   FVGRAPH_GPU_PART=flux_kontext_step bash perf/gpu_check.sh  # the same on FLUX.1 Kontext dev's config, a 1024x1024 condition image (4,096 more tokens); est. 530 s (96 GB of weights: an H200)
#   FVGRAPH_GPU_PART=run_ahead   bash perf/gpu_check.sh  # device idle between replays, serial vs run-ahead: Wan 1.3B config, 256x256x17, -O2, buckets 4, 8 (bucket 1 measured 2026-12-04; FVGRAPH_IDLE_BUCKETS); est. 400 s
#   FVGRAPH_GPU_PART=memory      bash perf/gpu_check.sh  # bench_memory: Wan 2.2 A14B's config (seeded, bf16) at 720x1280x81 under an 80 GB cap, one expert resident + tiled decode; est. 450 s (two 14B seeded inits)
#   FVGRAPH_GPU_PART=memory_resident bash perf/gpu_check.sh  # the same with everything resident (expected: out of memory under the cap); est. 400 s
#   FVGRAPH_GPU_PART=memory_blocks bash perf/gpu_check.sh  # the same with offload="blocks:4" (both experts' blocks streamed) + tiled decode; est. 450 s
#   FVGRAPH_GPU_PART=offload_blocks bash perf/gpu_check.sh  # tests/test_offload_blocks.py's gpu tests: -O2 CUDA-graph replay with three streamed blocks and its copy counts, the copies' overlap with kernels (-O0, -O2); est. 150 s
#   FVGRAPH_GPU_PART=offload     bash perf/gpu_check.sh  # the gpu tests of tests/test_offload.py (-O2 replay with one expert on the device, the build's device peak) and tests/test_sleep_wake.py (graphs dropped at sleep, captured again after wake); est. 150 s
#   FVGRAPH_GPU_PART=all         bash perf/gpu_check.sh  # everything, in one long call (default)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
OUT="$(realpath -m "${OUT:-perf/results/$(date +%Y-%m-%d)-gpu}")"
PART="${FVGRAPH_GPU_PART:-all}"
PARTS="probe tests tests_loops aoti aoti_probe step flux_step flux_kontext_step hv15_step serving kernels coldstart coldstart_b48 cache http interceptors parallel lora lora_r128 distilled rollouts run_ahead memory memory_resident memory_blocks offload_blocks offload all"
case " $PARTS " in
  *" $PART "*) ;;
  *) echo "error: FVGRAPH_GPU_PART=$PART is not a part; the parts are: $PARTS" >&2; exit 2 ;;
esac
# Before anything else: without the carried wheels every test stops at `import diffusers` (docs/gpu.md).
if ! compgen -G "wheels/*.whl" >/dev/null; then
  echo "error: $REPO/wheels/ holds no wheels. Fix: on a machine with a package index run" \
       "'bash perf/fetch_gpu_wheels.sh' (it fills wheels/), and carry wheels/ with the checkout to this machine" \
       "(it is git-ignored, so a copy of the tracked files leaves it behind)." >&2
  exit 2
fi
mkdir -p "$OUT"
# PYTHONFAULTHANDLER: a crash (SIGSEGV in a loader, say) prints every thread's Python stack into the log.
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/fvgraph-inductor}"

site=/tmp/fvgraph-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" wheels/*.whl || exit 1
# On the path before fvgraph is built: its build (no isolation, no index) then uses the carried setuptools,
# whatever the machine has (an old one, or none at all in a Python 3.12 venv).
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$site" . || exit 1
# Run from outside the checkout: `python -m` puts the working directory first on sys.path, and the
# checkout's fvgraph/ folder would shadow the installed package (whose passes/, cards/ and
# perf/ install as fvgraph.passes, ... and are not inside that folder).
mkdir -p /tmp/fvgraph-run && cd /tmp/fvgraph-run || exit 1
python3 -c "import fvgraph.cards, fvgraph.passes, fvgraph.kernels, fvgraph.perf" || exit 1

run() {  # run NAME TIMEOUT_S COMMAND...: output to $OUT/NAME.log, keep going on failure
  # SIGINT at the limit, so pytest still prints its summary (-rA, --durations); SIGKILL 20 s later.
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit} s)"
  timeout -s INT -k 20 "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "rc=$?" >>"$OUT/$name.log"
  tail -n 3 "$OUT/$name.log"
}
part() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }
PYTEST=(python3 -m pytest -m gpu -v -rA --durations=0 -p no:cacheprovider)
# -s and live INFO logs for the tests that crashed or failed before: a crash loses pytest's captured output.
VERBOSE=(-s --log-cli-level=INFO)
INDUCTOR_STEP="test_cuda_inductor_step_matches_eager_with_no_recompiles"
CAPTURE_CACHE="test_capture_cache_serves_graphs_on_cuda_with_zero_compiles"
LOOPS_TESTS=("$REPO/tests/test_fb_cache.py" "$REPO/tests/test_taylor_seer.py" "$REPO/tests/test_ti2v.py" "$REPO/tests/test_http_gpu.py" "$REPO/tests/test_hunyuan_video15_gpu.py")

# The limits of each part add up to at most 540 s (docs/gpu.md lists them with the estimates).
part probe && run env 30 python3 -m fvgraph env --json
part probe && run tf32_probe 60 python3 "$REPO"/perf/tf32_probe.py
part probe && run parity_o2 150 python3 -m fvgraph parity --card tiny-wan -O2 --against 0 --device cuda --report "$OUT/parity_o2.jsonl"
# 93 s on the H200 on 2026-12-04 (four tiny-wan inductor compiles of 18-26 s): a 90 s limit cut it.
part probe && run pytest_inductor_step 150 "${PYTEST[@]}" "${VERBOSE[@]}" -k "$INDUCTOR_STEP" "$REPO/tests/test_gpu.py"
# The warm start of the default artifact format on CUDA, first in its part: a cold start fills a capture
# cache (standalone artifacts), a fresh frozen process loads it; each start prints its phases.
part coldstart && run bench_coldstart 540 python3 "$REPO"/perf/bench_coldstart.py --gpu --buckets 1 --artifact-format standalone --timeout 330
part coldstart && grep -h '^phases\|^{' "$OUT/bench_coldstart.log"
part tests && run env 30 python3 -m fvgraph env --json
part tests && run pytest_gpu 480 "${PYTEST[@]}" -k "not capture_cache" "$REPO/tests/test_gpu.py" "$REPO/tests/test_kernels.py" "$REPO/tests/test_projection_cache.py" "$REPO/tests/test_lora_fp8.py"
part tests_loops && run pytest_gpu_loops 520 "${PYTEST[@]}" "${LOOPS_TESTS[@]}"
# Alone in its part: 282 s on 2026-12-04 (two engines, each a compile, two package builds and a child load that died of SIGSEGV).
part aoti && run pytest_gpu_aoti 540 "${PYTEST[@]}" "${VERBOSE[@]}" -k "$CAPTURE_CACHE and aoti" "$REPO/tests/test_gpu.py"
part aoti_probe && run aoti_load_probe 300 env OUT="$OUT/aoti_load_probe" python3 "$REPO"/perf/aoti_load_probe.py
part step && run bench_step 540 python3 "$REPO"/perf/bench_step.py --gpu --shapes 480x832x33 --levels 1,2,3 --batch 1 --baselines eager,compile_repeated_blocks
part flux_step && run bench_step_flux 570 python3 "$REPO"/perf/bench_step.py --gpu --card flux.1-dev-bench --shapes 1024x1024x1 --levels 1,2 --batch 1 --baselines eager,compile_repeated_blocks --repeats 10
part hv15_step && run bench_step_hv15 540 python3 "$REPO"/perf/bench_step.py --gpu --card hunyuanvideo1.5-480p-bench --shapes 480x848x17 --levels 1,2 --batch 1 --baselines eager,compile_repeated_blocks --repeats 10
part flux_kontext_step && run bench_step_flux_kontext 570 python3 "$REPO"/perf/bench_step.py --gpu --card flux.1-kontext-dev-bench --shapes 1024x1024x1 --levels 1,2 --batch 1 --baselines eager,compile_repeated_blocks --repeats 10
part serving && run bench_serving 420 python3 "$REPO"/perf/bench_serving.py --gpu --buckets 1 4 --requests 12 --repeats 1
part serving && run bench_scheduler_overhead 120 python3 "$REPO"/perf/bench_scheduler_overhead.py --gpu
part kernels && run bench_kernels 540 python3 "$REPO"/perf/bench_kernels.py --gpu --out "$OUT/bench_kernels.jsonl"
part coldstart_b48 && run bench_coldstart_b48 540 python3 "$REPO"/perf/bench_coldstart.py --gpu --buckets 4,8 --timeout 480
part lora && run bench_lora 540 python3 "$REPO"/perf/bench_lora.py --gpu --ranks 32 --batch 4 --repeats 10 --no-references
part lora_r128 && run bench_lora_r128 540 python3 "$REPO"/perf/bench_lora.py --gpu --ranks 128 --batch 4 --repeats 10 --no-references
part distilled && run bench_distilled 540 python3 "$REPO"/perf/bench_distilled.py --gpu --repeats 1
part rollouts && run bench_rollouts 540 python3 "$REPO"/perf/bench_rollouts.py --gpu --repeats 2
# One engine (one inductor compile of the 1.3B step) per bucket, each in its own limit: bucket 1 took
# about 180 s on 2026-12-04 (its line is in perf/results/2026-12-04-h200.jsonl), so two buckets fit a part.
for b in ${FVGRAPH_IDLE_BUCKETS:-4 8}; do
  part run_ahead && run bench_replay_idle_b$b 250 python3 "$REPO"/perf/bench_scheduler_overhead.py --gpu --idle --idle-buckets $b --steps 12 --repeats 3
done
part cache && run bench_projection_cache 150 python3 "$REPO"/perf/bench_projection_cache.py --gpu
part http && run bench_http 540 python3 "$REPO"/perf/bench_http.py --gpu --repeats 1 --startup-timeout 240
# The step-caching method under test: FVGRAPH_CACHE_METHOD (default magcache; the issue's target is teacache at 0.08).
part interceptors && run bench_interceptors 540 python3 "$REPO"/perf/bench_interceptors.py --gpu --repeats 2 --methods "${FVGRAPH_CACHE_METHOD:-magcache}" ${FVGRAPH_CACHE_SETTING:+--setting "$FVGRAPH_CACHE_SETTING"}
part parallel && run pytest_gpu_parallel 300 "${PYTEST[@]}" -k degree_1 "$REPO/tests/test_parallel.py"
part parallel && run generate_parallel 120 python3 -m fvgraph generate --cfg-parallel 1 --ulysses 1 -O2 --device cuda --steps 4 -o "$OUT/parallel.gif"
# Two 14B experts initialized from a seed on the host each time (about 2-4 min): one case per part.
part memory && run bench_memory 540 python3 "$REPO"/perf/bench_memory.py --gpu --case one_expert_tiled
part memory_resident && run bench_memory_resident 540 python3 "$REPO"/perf/bench_memory.py --gpu --case everything_resident
part memory_blocks && run bench_memory_blocks 540 python3 "$REPO"/perf/bench_memory.py --gpu --case blocks_tiled
part offload_blocks && run pytest_gpu_offload_blocks 300 "${PYTEST[@]}" "$REPO/tests/test_offload_blocks.py"
part offload && run pytest_gpu_offload 300 "${PYTEST[@]}" "$REPO/tests/test_offload.py"
part offload && run pytest_gpu_sleep 200 "${PYTEST[@]}" "$REPO/tests/test_sleep_wake.py"
cat "$OUT"/bench_*.log "$OUT"/tf32_probe.log 2>/dev/null | grep -h '^{' >"$OUT/results.jsonl"
echo "results in $OUT"
