#!/bin/bash
# Run benchmarks/quality.py on a CUDA machine from a queue of argument lines (one run per line),
# PARALLEL runs at a time on the one GPU (a 135M model at batch 8 leaves it mostly idle), resuming where
# a previous call stopped: finished lines are recorded in $STATE/done, rows in $STATE/quality-gpu.jsonl
# (each run appends its row in one write).
#   QUEUE=benchmarks/dev/quality_queue.txt STATE=/tmp/qres PARALLEL=6 bash benchmarks/dev/quality_gpu.sh
# Needs the SmolLM2 GGUF file at $PEFT_SPARSE_CACHE/smollm2-135m-instruct/ and peft, gguf importable.
# A machine without network access and with a per-call transfer limit below the file's 98 MB gets it in halves:
#   here:  split -b 50000000 ~/.cache/peft_sparse/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf .dev_model/part-
#   call 1 (carrying .dev_model/part-aa and the peft + gguf wheels): cp .dev_model/part-aa /tmp/pm/
#   call 2 (carrying .dev_model/part-ab): cat /tmp/pm/part-aa .dev_model/part-ab > $PEFT_SPARSE_CACHE/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
#   (sha256 b179c952…db53), then PYTHONPATH=<wheels>:$PWD bash benchmarks/dev/quality_gpu.sh
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
grep -v '^\s*#' "${QUEUE:-benchmarks/dev/quality_queue.txt}" | grep -v '^\s*$' \
  | xargs -d '\n' -P "$PARALLEL" -I{} bash -c 'run_line "$1"' _ {}
