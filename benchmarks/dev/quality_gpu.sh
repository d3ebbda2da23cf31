#!/bin/bash
# Run benchmarks/quality.py on a CUDA machine from a queue of argument lines (one run per line),
# resuming where a previous call stopped: finished lines are recorded in $STATE/done.
#   QUEUE=benchmarks/dev/quality_queue.txt STATE=/tmp/qres bash benchmarks/dev/quality_gpu.sh
# Needs the SmolLM2 GGUF file at $PEFT_SPARSE_CACHE/smollm2-135m-instruct/ and peft, gguf importable.
# A machine without network access and with a per-call transfer limit below the file's 98 MB gets it in halves:
#   here:  split -b 50000000 ~/.cache/peft_sparse/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf .dev_model/part-
#   call 1 (carrying .dev_model/part-aa and the peft + gguf wheels): cp .dev_model/part-aa /tmp/pm/
#   call 2 (carrying .dev_model/part-ab): cat /tmp/pm/part-aa .dev_model/part-ab > $PEFT_SPARSE_CACHE/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
#   (sha256 b179c952…db53), then PYTHONPATH=<wheels>:$PWD bash benchmarks/dev/quality_gpu.sh
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
