#!/bin/bash
# One GPU call of quality runs, after a call that left the model's first half in /tmp/pm (see quality_gpu.sh): joins
# the halves into the cache, then runs the quality queue (QUEUE, PARALLEL at a time) and, beside it, the 1,000-step
# runs of instruction_1k.sh named by the I1K_* variables; rows are copied to $OUT at the end (or at LIMIT seconds).
#   QUEUE=benchmarks/dev/quality_queue.txt PARALLEL=8 I1K_METHODS=spiel I1K_TASKS=skills2 I1K_SEEDS="1 2" \
#     I1K_FLAGS="--set training.weight_decay=1.0" bash benchmarks/dev/quality_round.sh
set -u
export PYTHONPATH=/tmp/site:$PWD PEFT_SPARSE_CACHE=/tmp/psc HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-540}
M=$PEFT_SPARSE_CACHE/smollm2-135m-instruct
mkdir -p "$M"
[ -f "$M/SmolLM2-135M-Instruct.Q4_1.gguf" ] || cat /tmp/pm/part-aa .dev_model/part-ab > "$M/SmolLM2-135M-Instruct.Q4_1.gguf"
sha256sum "$M/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -c1-16
python3 -c "from peft_sparse.assets import load_model_and_tokenizer as load; load('smollm2-135m-instruct')" > /tmp/convert.log 2>&1 || { tail -5 /tmp/convert.log; exit 1; }
mkdir -p /tmp/qres /tmp/i1k
if [ -n "${I1K_METHODS:-}" ]; then
  ( METHODS=$I1K_METHODS TASKS=${I1K_TASKS:-skills2} SEEDS=${I1K_SEEDS:-0} SPIEL_FLAGS=${I1K_FLAGS:-} PARALLEL=${I1K_PARALLEL:-4} \
    WORK=/tmp/i1k RESULTS=/tmp/i1k/results.jsonl timeout $LIMIT bash benchmarks/instruction_1k.sh ) > /tmp/i1k.log 2>&1 &
fi
STATE=/tmp/qres DEADLINE=${DEADLINE:-300} timeout $LIMIT bash benchmarks/dev/quality_gpu.sh
wait
cat /tmp/i1k.log 2>/dev/null | grep -v "^Failed to load" | tail -8
cp /tmp/qres/quality-gpu.jsonl "$OUT/" 2>/dev/null; cp /tmp/i1k/results.jsonl "$OUT/instruction-1k.jsonl" 2>/dev/null
python3 benchmarks/quality.py table /tmp/qres/quality-gpu.jsonl 2>/dev/null
