#!/usr/bin/env bash
# Issue 5's load run on a CUDA machine inside a fixed wall-clock budget (a lent GPU's minutes): the issue's form
# (streamed chats through the `openai` client over aiohttp beside a fine-tuning job, both paths interleaved on one
# server, `--repeats 2`), then one request at a time without a job, each given what time is left. Every step's log
# is written under OUT as it runs, so a step cut by the budget (or a call cut by its limit) keeps what it printed.
#
#   OUT=runs/cuda_server DATA=../shared/data BUDGET=420 bash benchmarks/cuda_server.sh
#
# Settings (environment): MODEL (created with the small preset if missing), DATA (sharegpt_trace.json,
# alpaca_en_demo.json), OUT, BUDGET (seconds for the whole script), N (requests of the load run), RATE (req/s),
# N0 (requests one at a time; 0 skips that step), PY. On the H200s of 2026-11-27 the load run took about 100 s per
# 250 requests at 5 req/s with its server's start, so N=500 needs some 260 s; 200 requests took 195 s in all
# with a model already made. The rate-0 step takes 40-90 s.
set -u
OUT=${OUT:-runs/cuda_server}
BUDGET=${BUDGET:-420}
N=${N:-500}
RATE=${RATE:-5}
N0=${N0:-60}
. "$(dirname "$0")/budget.sh"

say "machine"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $PY -c "import platform, torch, openai, fastapi, aiohttp; print('python', platform.python_version(), 'torch',
torch.__version__, 'openai', openai.__version__, 'fastapi', fastapi.__version__, 'aiohttp', aiohttp.__version__,
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"; } 2>&1 | tee -a "$OUT/steps.log"
[ -f "$MODEL/config.json" ] || $CS create-model "$MODEL" --preset small >/dev/null || exit 1

say "the issue's form: $N requests at $RATE req/s, interleaved, --repeats 2"
timeout -k 5 "$(left)" $CS bench-server --model "$MODEL" --num-requests "$N" --rate "$RATE" --phase interleaved \
    --repeats 2 --client-http aiohttp --prompts "$DATA/sharegpt_trace.json" \
    --finetune-data "$DATA/alpaca_en_demo.json" --out "$OUT/server_interleaved.json" > "$OUT/interleaved.log" 2>&1
say "exit $? ($(grep -c . "$OUT/interleaved.log") log lines)"

if [ "$N0" -gt 0 ] && [ "$(left)" -gt 40 ]; then
    say "one request at a time: $N0 chats, no job"
    timeout -k 5 "$(left)" $CS bench-server --model "$MODEL" --num-requests "$N0" --rate 0 --phase both \
        --client-http aiohttp --prompts "$DATA/sharegpt_trace.json" --finetune-data none \
        --out "$OUT/server_rate0.json" > "$OUT/rate0.log" 2>&1
    say "exit $?"
fi
say "done"
grep -v "^INFO\|access" "$OUT/interleaved.log" | tail -25
