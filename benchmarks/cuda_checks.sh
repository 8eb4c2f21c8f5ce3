#!/usr/bin/env bash
# What a lent GPU's first minutes should run, in one call inside a fixed wall-clock budget: every test that needs
# CUDA (they are skipped on a CPU), then the benchmarks whose GPU figures are missing or old: generation against HF
# transformers with and without many LoRA adapters (against PEFT's mixed adapter batch), finetuning against HF PEFT,
# and where a finetuning sequence's time goes (the job against plain autograd). Each step's log is written under OUT
# as it runs, so a step cut by the budget (or a call cut by its limit) keeps what it printed.
#
#   OUT=runs/cuda_checks DATA=../shared/data BUDGET=540 bash benchmarks/cuda_checks.sh
#
# Settings (environment): MODEL (created with the small preset if missing), DATA (sharegpt_trace.json,
# alpaca_en_demo.json), OUT, BUDGET (seconds for the whole script), ADAPTERS (LoRA adapters of the multi-adapter
# generation run), DEVICE (cuda; cpu runs the same steps here, the CUDA tests then skipping), PY.
#
# On a lent H200/H100 (2026-11-28): the image has torch, transformers and peft but not the server's packages; carry
# wheels of fastapi, starlette, pydantic(-core), annotated-types, typing-inspection, typing_extensions, uvicorn,
# httptools, python-multipart, openai, distro, jiter, sniffio, jsonschema(-specifications), referencing, rpds-py,
# lark, rapidfuzz, nltk and opentelemetry-api (FastAPI 0.165 imports it; without it test_engine_faults.py did not
# import). With 16 cores, PYTEST_ADDOPTS="-n 8" (pytest-xdist is in the image) ran the CUDA tests in 33 s and the
# whole script in 185 s. Each xdist worker times its own GEMM backend: on that host one picked oneDNN, whose packs
# are not batch-invariant there (the engine now re-packs for MKL: batch_invariance.plan_fusion).
set -u
OUT=${OUT:-runs/cuda_checks}
BUDGET=${BUDGET:-540}
ADAPTERS=${ADAPTERS:-4}
DEVICE=${DEVICE:-cuda}
. "$(dirname "$0")/budget.sh"
# run NAME SECONDS CMD...: the step under a limit of its own and what is left of the budget, its log in OUT/NAME.log
run() {
  local name=$1 limit=$2
  shift 2
  local budget_left
  budget_left=$(left)
  [ "$limit" -gt "$budget_left" ] && limit=$budget_left
  if [ "$limit" -lt 20 ]; then say "$name: skipped, ${budget_left} s left"; return; fi
  say "$name (up to $limit s)"
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  say "$name: exit $? ($(tail -c 300 "$OUT/$name.log" | tr '\n' ' ' | cut -c1-200))"
}

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  | tee -a "$OUT/steps.log"
$PY -c "import torch, platform; print(platform.python_version(), torch.__version__,
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')" | tee -a "$OUT/steps.log"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/steps.log"
[ -f "$MODEL/config.json" ] || $CS create-model "$MODEL" --preset small > /dev/null || exit 1

run cuda_tests 240 $PY -m pytest -q -p no:cacheprovider -rs tests/test_cuda_architectures.py tests/test_decode_graphs.py \
  tests/test_decode_attention.py \
  tests/test_batch_invariance.py tests/test_finetune_windows.py tests/test_engine_faults.py tests/test_sampling.py \
  tests/test_bench_serving.py::test_spatial_trains_on_a_cuda_stream_of_its_own \
  "tests/test_model_parity.py::test_a_sliding_window_model_attends_past_its_window_as_hf_does" \
  "tests/test_model_parity.py::test_a_model_whose_every_layer_slides_frees_the_blocks_behind_its_window" \
  "tests/test_model_parity.py::test_sliding_layers_beside_whole_context_ones_keep_their_k_v_in_a_pool_of_their_own" \
  tests/test_expert_lora.py tests/test_moe.py
run generation_lora 150 $CS bench-generation --model "$MODEL" --device "$DEVICE" --adapters "$ADAPTERS" \
  --sharegpt "$DATA/sharegpt_trace.json" --out "$OUT/generation_lora.json"
run generation_base 90 $CS bench-generation --model "$MODEL" --device "$DEVICE" \
  --sharegpt "$DATA/sharegpt_trace.json" --out "$OUT/generation_base.json"
run finetune_profile 120 $PY benchmarks/finetune_profile.py --model "$MODEL" --device "$DEVICE" \
  --data "$DATA/alpaca_en_demo.json" --repeats 3
run bench_finetune 180 $CS bench-finetune --model "$MODEL" --device "$DEVICE" --data "$DATA/alpaca_en_demo.json" \
  --config cheap:0 --out "$OUT/bench_finetune.json"
# sliding windows' KV memory (not yet run on a GPU): a small Gemma 3 (its sliding layers' own pool against the main
# blocks, on the same KV memory) and a small Mistral sliding over 256 positions (blocks behind the window released)
SLIDING=${SLIDING:-models/sliding}
[ -f "$SLIDING/gemma3/config.json" ] || $CS create-model "$SLIDING/gemma3" --preset small --arch gemma3 > /dev/null
if [ ! -f "$SLIDING/mistral/config.json" ]; then
  $CS create-model "$SLIDING/mistral" --preset small --arch mistral > /dev/null
  $PY -c "import json, sys; p = sys.argv[1]; c = json.load(open(p)); c['sliding_window'] = 256; \
json.dump(c, open(p, 'w'))" "$SLIDING/mistral/config.json"
fi
run sliding_pool 120 $PY benchmarks/sliding_window_kv.py --model "$SLIDING/gemma3" --device "$DEVICE" --requests 16 \
  --prompt-tokens 128 --max-tokens 640 --kv-cache-memory-gb 0.0390625 --out "$OUT/sliding_pool.json"
run sliding_release 120 $PY benchmarks/sliding_window_kv.py --model "$SLIDING/mistral" --device "$DEVICE" \
  --requests 16 --prompt-tokens 128 --max-tokens 640 --num-kv-blocks 320 --out "$OUT/sliding_release.json"
say "done"
