#!/bin/bash
# Run benchmarks/quality.py on a CUDA machine from a queue of argument lines (one run per line),
# resuming where a previous call stopped: finished lines are recorded in $STATE/done.
#   QUEUE=benchmarks/dev/quality_queue.txt STATE=/tmp/qres bash benchmarks/dev/quality_gpu.sh
# Needs the SmolLM2 GGUF file at $PEFT_SPARSE_CACHE/smollm2-135m-instruct/ and peft, gguf importable.
set -u
STATE=${STATE:-/tmp/qres}
DEADLINE=${DEADLINE:-540}   # seconds: start no run after this
mkdir -p "$STATE"
touch "$STATE/done"
start=$(date +%s)
while IFS= read -r line; do
  [[ -z "$line" || "$line" == \#* ]] && continue
  grep -qxF -- "$line" "$STATE/done" && continue
  (( $(date +%s) - start > DEADLINE )) && break
  echo "== $line"
  # shellcheck disable=SC2086
  if python3 benchmarks/quality.py run --device cuda --out "$STATE/quality-gpu.jsonl" $line; then
    echo "$line" >> "$STATE/done"
  fi
done < "${QUEUE:-benchmarks/dev/quality_queue.txt}"
