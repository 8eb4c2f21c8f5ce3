#!/usr/bin/env bash
# The co-serving sweep on a CUDA machine, every policy, inside a fixed wall-clock budget (a lent GPU's minutes):
# the latency model profiled first, then the runs in order of what they decide (zero load, the light and the heavy
# end, the middle), the CUDA-only tests, and `spatial` with whatever time is left. Every `coserve bench` writes its
# JSON after each run, so a step cut by the budget keeps the runs it finished.
#
#   OUT=runs/cuda_sweep DATA=../shared/data BUDGET=570 bash benchmarks/cuda_sweep.sh
#
# Settings (environment): MODEL (created with the small preset if missing), DATA (alpaca_en_demo.json,
# azure_llm_2023_code.csv, sharegpt_trace.json), OUT, BUDGET (seconds for the whole script), DUR (seconds of
# arrivals per run), DRAIN, LIGHT / MID / HEAVY (req/s), PRESET, DTYPE, PROFILE_POINTS, FT_SEQ_LEN, TESTS (0: skip
# them), FUSE (--fuse-finetuning for the profile and every run: auto, always, never; `never` keeps decode rows on
# their CUDA graphs and runs windows in calls of their own), EXTRA (more `coserve bench` options for every run, e.g.
# "--slo-margin-max 0.3"), POLICIES (the policies run at LIGHT, HEAVY and MID, space-separated; default every one
# but spatial, which runs last), TEST_ARGS (the pytest arguments of the CUDA tests). An empty MID or HEAVY skips
# that rate.
# The H200 of 2026-11-26 took about 36 s per run of 15 s arrivals with a 5 s drain (about 20 s to start each run's
# process), so BUDGET=555 covered the profile and 13 runs; a run ends once its requests are done, so the 15 s drain
# costs only where some are still decoding. The rates here suit `small` float32 on an H100 or H200.
set -u
OUT=${OUT:-runs/cuda_sweep}
BUDGET=${BUDGET:-570}
DUR=${DUR:-15}
DRAIN=${DRAIN:-15}  # 5 s counted long late answers of `coserve` (TPOT 30-40 ms) as misses on the H200 (2026-11-26)
LIGHT=${LIGHT:-5}
MID=${MID-15}
HEAVY=${HEAVY-30}
PRESET=${PRESET:-small}
DTYPE=${DTYPE:-float32}
PROFILE_POINTS=${PROFILE_POINTS:-60}
TESTS=${TESTS:-1}
FUSE=${FUSE:-auto}
EXTRA=${EXTRA:-}
FT_SEQ_LEN=${FT_SEQ_LEN:-1024}
TEST_ARGS=${TEST_ARGS:-tests/test_decode_graphs.py tests/test_decode_attention.py tests/test_batch_invariance.py
tests/test_finetune_windows.py tests/test_bench_serving.py::test_spatial_trains_on_a_cuda_stream_of_its_own
tests/test_sampling.py::test_sampling_on_cuda_filters_as_on_cpu_and_draws_within_the_filter}
. "$(dirname "$0")/budget.sh"

say "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
$PY -c "import torch, transformers, platform; print('python', platform.python_version(), 'torch', torch.__version__,
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0),
'threads', torch.get_num_threads())"

[ -f "$MODEL/config.json" ] || $CS create-model "$MODEL" --preset "$PRESET" --dtype "$DTYPE"
say "profile"
timeout -k 5 "$(left)" $CS profile --model "$MODEL" --dtype "$DTYPE" --points "$PROFILE_POINTS" \
    --fuse-finetuning "$FUSE" --out "$OUT/latency.json"

W=(--duration "$DUR" --drain "$DRAIN" --slo-tpot-ms 50 --ttft-limit-s 5 --dtype "$DTYPE" --fuse-finetuning "$FUSE"
   --trace "$DATA/azure_llm_2023_code.csv" --trace-start 63 --prompts "$DATA/sharegpt_trace.json"
   --finetune-data "$DATA/alpaca_en_demo.json" --finetune-seq-len "$FT_SEQ_LEN" --latency-model "$OUT/latency.json"
   --no-progress)
POLICIES=${POLICIES:-inference-only coserve temporal:64 dts separate}
ALL=()
for p in $POLICIES; do ALL+=(--policy "$p"); done

step() {  # step NAME ARGS...: one `coserve bench` into $OUT/NAME.json, cut at the budget
    local name=$1 t
    shift
    t=$(left)
    if [ "$t" -lt 30 ]; then say "skipped $name: ${t} s left"; return; fi
    say "$name"
    # shellcheck disable=SC2086  # EXTRA is a list of options
    timeout -k 5 "$t" $CS bench --model "$MODEL" "$@" "${W[@]}" $EXTRA --out "$OUT/$name.json"
}

step idle --policy finetune-only --policy coserve --rate 0
step light "${ALL[@]}" --rate "$LIGHT"
[ -n "$HEAVY" ] && step heavy "${ALL[@]}" --rate "$HEAVY"
[ -n "$MID" ] && step mid "${ALL[@]}" --rate "$MID"
if [ "$TESTS" = 1 ] && [ "$(left)" -gt 60 ]; then
    say "CUDA tests"
    # shellcheck disable=SC2086  # TEST_ARGS is a list of arguments
    timeout -k 5 "$(($(left) - 30))" $PY -m pytest -q -p no:cacheprovider $TEST_ARGS 2>&1 | tail -5
fi
step spatial --policy spatial --rate "$LIGHT" ${HEAVY:+--rate "$HEAVY"} ${MID:+--rate "$MID"}
say "done"
