# What the cuda_*.sh scripts share, sourced after each has set its own settings (OUT and BUDGET at least): the
# defaults every one of them takes, the clock of its wall-clock budget, and a log of its steps in OUT/steps.log.
MODEL=${MODEL:-models/coserve-small}
DATA=${DATA:-../shared/data}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1

start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }  # seconds of the budget left
say() { echo "[$(($(date +%s) - start)) s] $*" | tee -a "$OUT/steps.log"; }
mkdir -p "$OUT"
CS="$PY -m coserve.cli"
