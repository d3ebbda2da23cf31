#!/bin/bash
# Produces BENCHMARKS.md, "Quality", GPU tier: runs benchmarks/quality.py on a CUDA machine from a queue of argument
# lines (one `quality.py run` per line, e.g. `--task skills --steps 150 --method spiel-ag --lr 1e-3 --seeds 0`),
# PARALLEL runs at a time on the one GPU (a 135M model at batch 8 leaves it mostly idle), resuming where a previous
# call stopped: finished lines are recorded in $STATE/done, rows in $STATE/quality-gpu.jsonl (each run appends its
# row in one write); `python benchmarks/quality.py table $STATE/quality-gpu.jsonl` prints the table.
#   QUEUE=runs.txt STATE=/tmp/qres PARALLEL=6 bash benchmarks/quality_gpu.sh
# Needs the SmolLM2 model converted once into $PEFT_SPARSE_CACHE (the first peft-sparse run does it).
set -u
export STATE=${STATE:-/tmp/qres}
export DEADLINE=${DEADLINE:-540}   # seconds: start no run after this
PARALLEL=${PARALLEL:-1}
mkdir -p "$STATE"
touch "$STATE/done"
run_line() {
  local line="$1"
  [[ -z "$line" || "$line" == \#* ]] && return 0
  grep -qxF -- "$line" "$STATE/done" && return 0
  (( $(date +%s) - START > DEADLINE )) && return 0
  echo "== $line"
  # shellcheck disable=SC2086
  if python3 benchmarks/quality.py run --device cuda --threads 2 --out "$STATE/quality-gpu.jsonl" $line \
      > "$STATE/log-$BASHPID.txt" 2>&1; then
    echo "$line" >> "$STATE/done"
    echo "ok $line"
  else
    echo "FAILED $line"; tail -5 "$STATE/log-$BASHPID.txt"
  fi
}
export -f run_line
# convert the GGUF file into the cache once, before parallel runs race to write it
python3 -c "from peft_sparse.assets import load_model_and_tokenizer as load; load('smollm2-135m-instruct')" > /dev/null 2>&1
export START=$(date +%s)   # (DEADLINE counts from here, after the conversion)
grep -v '^\s*#' "${QUEUE:?QUEUE=file of quality.py run argument lines}" | grep -v '^\s*$' \
  | xargs -d '\n' -P "$PARALLEL" -I{} bash -c 'run_line "$1"' _ {}
