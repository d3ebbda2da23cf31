#!/bin/bash
# The quality benchmark on one CUDA GPU: the runs of `benchmarks/quality.py plan` (test families, 150 steps, seeds
# 0-2, three training paths, LoRA r16 / fixed mask / SpIEL-AG / SpIEL-MA / SpIEL-AG reference='authors'; then 600
# steps; then SHiRA, full fine-tuning and SpIEL-MA reference='authors'), in that priority order, WORKERS processes
# sharing the GPU (SmolLM2-135M at batch 8 leaves it mostly idle). Each finished run appends its row to
# $OUT/quality-gpu.jsonl at once, so a command stopped at its limit keeps every run that finished.
#
#   bash benchmarks/quality_plan.sh stage            # call A: wheels installed, the model's first half kept in /tmp/pm
#   bash benchmarks/quality_plan.sh run [DONE.jsonl ...]
#                                                    # call B (and C): the model joined and converted once, then the plan;
#                                                    # lines whose rows are in DONE.jsonl (earlier calls) are skipped
#   bash benchmarks/quality_plan.sh time-one         # one SpIEL-AG run of 150 steps, alone, with where its time went
#
# Needs: the wheels in .whl, or the folder WHEELS names (peft, trl, datasets, gguf, ...; bitsandbytes is not needed), the SmolLM2 GGUF file split in .dev_model/part-aa and
# part-ab (`split -b 50000000 ~/.cache/peft_sparse/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
# .dev_model/part-`): the file is larger than one call may carry, so call A carries part-aa and call B part-ab on the
# same warm machine. Environment: WORKERS (default 12), LIMIT (seconds from the start after which workers are
# stopped, default 540; no run is started that this worker's timings say would end after LIMIT - 20), PLAN_SEEDS
# (the plan's seeds, default "0 1 2"), PLAN_FILE (run these argument lines instead of the plan), DEVICE (default cuda),
# TF32 (set: float32 matrix products in TF32, recorded in the rows' device; unset by default: plain float32).
set -u
START=$(date +%s)
MODE=${1:-run}
shift || true
LIMIT=${LIMIT:-540}
WORKERS=${WORKERS:-12}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/quality-out}
mkdir -p "$OUT" /tmp/qplan
export PYTHONPATH=/tmp/site:$PWD PEFT_SPARSE_CACHE=${PEFT_SPARSE_CACHE:-/tmp/psc} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
M=$PEFT_SPARSE_CACHE/smollm2-135m-instruct
GGUF=$M/SmolLM2-135M-Instruct.Q4_1.gguf

if ! python3 -c "import peft, gguf" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${WHEELS:-.whl}"/*.whl \
    || { echo "wheel install failed (carry ${WHEELS:-.whl})"; exit 1; }
fi

if [ "$MODE" = stage ]; then
  mkdir -p /tmp/pm && cp .dev_model/part-aa /tmp/pm/ && ls -l /tmp/pm && echo "staged in $(( $(date +%s) - START )) s"
  exit $?
fi

mkdir -p "$M"
if [ ! -d "$M/transformers" ] && [ ! -f "$GGUF" ]; then
  [ -f /tmp/pm/part-aa ] && [ -f .dev_model/part-ab ] \
    || { echo "the model is not here: run 'stage' (carrying .dev_model/part-aa) first on this warm machine, then carry .dev_model/part-ab"; exit 1; }
  cat /tmp/pm/part-aa .dev_model/part-ab > "$GGUF"
fi
[ -f "$GGUF" ] && sha256sum "$GGUF" | cut -c1-16
python3 -c "from peft_sparse.assets import load_model_and_tokenizer as load; load('smollm2-135m-instruct')" > /tmp/qplan/convert.log 2>&1 \
  || { tail -5 /tmp/qplan/convert.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
echo "model ready after $(( $(date +%s) - START )) s"

if [ "$MODE" = time-one ]; then
  python3 benchmarks/quality.py run --task sequences --method spiel-ag --steps 150 --device "$DEVICE" ${TF32:+--tf32} --threads 1 \
    --out "$OUT/quality-gpu.jsonl" --time-one 2>&1 | grep -v "^Failed to load\|Loading weights"
  exit 0
fi

if [ -n "${PLAN_FILE:-}" ]; then
  grep -v '^\s*#' "$PLAN_FILE" | grep -v '^\s*$' > /tmp/qplan/plan.txt
else
  # shellcheck disable=SC2086
  python3 benchmarks/quality.py plan ${PLAN_SEEDS:+--seeds $PLAN_SEEDS} > /tmp/qplan/plan.txt
fi
rm -f /tmp/qplan/plan.txt.claims
echo "plan: $(wc -l < /tmp/qplan/plan.txt) runs; skipping those in: ${*:-nothing}"
DEADLINE=$(( START + LIMIT - 20 ))
PIDS=()
for i in $(seq 1 "$WORKERS"); do
  python3 benchmarks/quality.py queue /tmp/qplan/plan.txt --device "$DEVICE" ${TF32:+--tf32} --threads 1 --out "$OUT/quality-gpu.jsonl" \
    --deadline "$DEADLINE" ${1:+--skip-done "$@"} > "/tmp/qplan/worker-$i.log" 2>&1 &
  PIDS+=($!)
done
rows() { [ -f "$OUT/quality-gpu.jsonl" ] && wc -l < "$OUT/quality-gpu.jsonl" || echo 0; }
while :; do
  alive=0
  for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=$((alive + 1)); done
  now=$(date +%s)
  [ "$alive" -eq 0 ] && break
  if (( now - START >= LIMIT )); then
    echo "limit reached: stopping $alive workers"
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
    sleep 2
    break
  fi
  if (( (now - START) % 60 < 10 )); then
    echo "t=$(( now - START )) s: $(rows) rows, $alive workers, GPU $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader)"
  fi
  sleep 10
done
cat /tmp/qplan/worker-*.log | grep -v "^Failed to load\|Loading weights\|FutureWarning\|warnings.warn" > "$OUT/quality-workers.log"
grep -h "^FAILED" /tmp/qplan/worker-*.log | head -20
python3 - "$OUT/quality-gpu.jsonl" "$(( $(date +%s) - START ))" "$WORKERS" <<'PY'
import json, statistics, sys
from pathlib import Path
path, seconds, workers = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
print(f"{len(rows)} rows in {seconds} s with {workers} workers")
for steps in sorted({r["steps"] for r in rows}):
    rs = [r for r in rows if r["steps"] == steps]
    wall = [r["wall_seconds"] for r in rs]
    print(f"  {steps} steps: {len(rs)} runs; per run (concurrent) wall median {statistics.median(wall):.0f} s, "
          f"train {statistics.median(r['train_seconds'] for r in rs):.0f} s ({statistics.median(r['median_step_ms'] for r in rs):.0f} ms/step), "
          f"eval {statistics.median(r['eval_seconds'] for r in rs):.0f} s")
PY
[ -s "$OUT/quality-gpu.jsonl" ] && python3 benchmarks/quality_summary.py "$OUT/quality-gpu.jsonl" ${1:+"$@"} > "$OUT/quality-summary.md" 2>&1 \
  && head -c 6000 "$OUT/quality-summary.md"
echo "done after $(( $(date +%s) - START )) s"
