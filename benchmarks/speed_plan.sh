#!/bin/bash
# The GPU speed tables of BENCHMARKS.md, each mode at most ten minutes, all on one machine:
#
#   bash benchmarks/speed_plan.sh a   # GPU tests; TinyLlama step table (default pass, opt-in merge, LoRA)
#   bash benchmarks/speed_plan.sh t   # the Trainer and SFTTrainer rows at TinyLlama and SmolLM2 shapes, 2 interleaved rounds
#                                     # each (the second in reverse order; "paired" column: × that round's LoRA)
#   bash benchmarks/speed_plan.sh p   # MA's accumulator update (ma_accumulators.py); host profiles (cProfile tables written
#                                     # under $OUT) of LoRA and the SpIEL rows in the Trainer at TinyLlama shapes, CUDA's
#                                     # synchronising calls of SpIEL-MA's, a block SpIEL-MA step of bench_step.py
#   bash benchmarks/speed_plan.sh k   # TinyLlama with the fast paths' composed pass instead of the default pass
#   bash benchmarks/speed_plan.sh c   # Llama-2-7B step table (floor, floor + dense dW, block and unstructured, default and opt-in; VARIANTS=a,b,...
#                                     # for some of them, TESTS=<pytest -k expression> runs those tests of test_gpu.py and
#                                     # test_triton_kernels.py first)
#   bash benchmarks/speed_plan.sh m   # MoE shapes
#   bash benchmarks/speed_plan.sh s   # SpIEL-AG's candidate choice (column-normalized, unstructured): the radix kernels' tests
#                                     # on the GPU, then candidate_selection.py at TinyLlama and 7B shapes (torch against kernel)
#   bash benchmarks/speed_plan.sh g   # the default-settings goals only, no tests: TinyLlama floor, block AG/MA and AG
#                                     # default and opt-in, LoRA, in 2 interleaved rounds after 60 s of settling (the
#                                     # second in reverse order after the floor)
#   bash benchmarks/speed_plan.sh h   # the block goals at TinyLlama shapes only: the floor and block AG/MA, default and
#                                     # opt-in, in 3 interleaved rounds after 60 s of settling (a round the host slowed does not decide;
#                                     # every second round in reverse order after the floor)
#   bash benchmarks/speed_plan.sh w   # the default pass's write lane: its GPU tests, then TinyLlama's floor and block AG/MA with and
#                                     # without the lane (--no-write-lane) and the opt-in rows, interleaved in rounds until the call's
#                                     # time is spent (every second round reversed after the floor); ratios to each round's floor
#   OLD=<tree> bash benchmarks/speed_plan.sh r
#                                     # before/after: the SpIEL and block rows of an older checkout's library and
#                                     # bench_step.py (OLD, e.g. a `git worktree` of the commit before a change) against
#                                     # this tree's, default pass and composed pass, interleaved in rounds at TinyLlama shapes
#
# Needs the wheels of peft, trl, datasets, gguf in .whl (carry it). Results are JSON lines under $OUT
# (default /tmp/speed-out); each benchmark prints its table at the end. STAGE=1 also copies .dev_model/part-aa to
# /tmp/pm for benchmarks/quality_plan.sh run on the same machine.
set -u
START=$(date +%s)
MODE=${1:-a}
OUT=${OUT:-/tmp/speed-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed (carry .whl)"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, peft, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'triton', triton.__version__)"
if [ -n "${STAGE:-}" ]; then mkdir -p /tmp/pm && cp .dev_model/part-aa /tmp/pm/ && echo "staged part-aa"; fi
left() { echo $(( ${LIMIT:-585} - ($(date +%s) - START) )); }
run() {  # run SECONDS CMD...: at most SECONDS, never past the call's limit
  local s=$1; shift
  local l; l=$(left); (( l < s )) && s=$l
  (( s < 20 )) && { echo "skipped (no time left): $*"; return; }
  echo "== [t=$(( $(date +%s) - START )) s, limit ${s} s] $*"
  timeout "$s" "$@" 2>&1 | grep -v "^Loading weights\|FutureWarning\|warnings.warn"
}
if [ "$MODE" = a ]; then
  run 220 python3 -m pytest tests/test_gpu.py tests/test_triton_kernels.py tests/test_transient_merge.py -q -p no:cacheprovider --maxfail=5
  run 260 python3 benchmarks/bench_step.py --size tinyllama \
    --variants floor,spiel-ag-block,spiel-ag-block-merge,spiel-ma-block,spiel-ma-block-merge,spiel-ag,spiel-ag-merge,spiel-ma,lora \
    --batch-id speed-a-tl --out "$OUT/bench-tinyllama.jsonl"
elif [ "$MODE" = g ]; then
  run 560 python3 benchmarks/bench_step.py --size tinyllama --rounds 2 --settle 60 \
    --variants floor,spiel-ag-block,spiel-ag-block-merge,spiel-ma-block,spiel-ma-block-merge,spiel-ag,spiel-ag-merge,lora \
    --batch-id speed-g-tl --out "$OUT/bench-tinyllama-rounds.jsonl"
elif [ "$MODE" = h ]; then
  run 560 python3 benchmarks/bench_step.py --size tinyllama --rounds 3 --settle 60 \
    --variants floor,spiel-ag-block,spiel-ag-block-merge,spiel-ma-block,spiel-ma-block-merge \
    --batch-id speed-h-tl --out "$OUT/bench-tinyllama-block-rounds.jsonl"
elif [ "$MODE" = t ]; then
  run 240 python3 benchmarks/trainer_step.py --size tinyllama --bs 8 --seq 512 --steps 40 --rounds 2 \
    --out "$OUT/trainer-tinyllama-rounds.jsonl"
  run 330 python3 benchmarks/trainer_step.py --size smollm2-135m --bs 8 --seq 128 --steps 50 --rounds 2 \
    --out "$OUT/trainer-smollm2-rounds.jsonl"
elif [ "$MODE" = p ]; then
  run 40 python3 benchmarks/ma_accumulators.py --out "$OUT/ma-accumulators.jsonl"
  for v in lora spiel-ma spiel-ma-block spiel-ag-block; do
    run 60 python3 benchmarks/trainer_step.py --size tinyllama --bs 8 --seq 512 --steps 20 --variants "$v" --trainers trainer \
      --profile 25 --profile-out "$OUT/prof" --out "$OUT/trainer-profiled.jsonl"
  done
  for v in spiel-ma spiel-ma-block; do
    run 50 python3 benchmarks/trainer_step.py --size tinyllama --bs 8 --seq 512 --steps 20 --variants "$v" --trainers trainer \
      --sync-debug --out "$OUT/trainer-sync-sites.jsonl"
  done
  run 50 python3 benchmarks/bench_step.py --size tinyllama --variant spiel-ma-block --host-profile 30 \
    --profile-out "$OUT/prof-step-spiel-ma-block.prof" --out "$OUT/step-profiled.jsonl"
elif [ "$MODE" = k ]; then
  run 200 python3 benchmarks/bench_step.py --size tinyllama --no-transient-cuda \
    --variants floor,spiel-ag-block,spiel-ma-block,spiel-ag,spiel-ma --batch-id speed-k-tl-composed --out "$OUT/bench-tinyllama-composed.jsonl"
elif [ "$MODE" = r ]; then
  [ -f "${OLD:-}/benchmarks/bench_step.py" ] || { echo "OLD must name an older tree with benchmarks/bench_step.py (carry it)"; exit 1; }
  round=0
  while (( $(left) > 290 )); do  # (a round: the floor and 3 variants × 3 trees, ~25 s a run; the trees' order reversed each round)
    round=$((round + 1))
    run 60 python3 benchmarks/bench_step.py --size tinyllama --variant floor --batch-id "r$round" --out "$OUT/refactor-floor.jsonl"
    for v in spiel-ag spiel-ag-block spiel-ma-block; do
      trees="old composed default"; (( round % 2 == 0 )) && trees="default composed old"
      for tree in $trees; do
        case $tree in
          old) run 60 python3 "$OLD/benchmarks/bench_step.py" --size tinyllama --variant "$v" --batch-id "r$round" --out "$OUT/refactor-old.jsonl" ;;
          composed) run 60 python3 benchmarks/bench_step.py --size tinyllama --variant "$v" --no-transient-cuda --batch-id "r$round" --out "$OUT/refactor-composed.jsonl" ;;
          default) run 60 python3 benchmarks/bench_step.py --size tinyllama --variant "$v" --batch-id "r$round" --out "$OUT/refactor-default.jsonl" ;;
        esac
      done
    done
  done
  python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
def rows(name):
    path = out / f"refactor-{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
floor = {r["batch_id"]: r["step_s_median"] for r in rows("floor")}
print("median step × that round's floor (median over rounds; each round's value in brackets)")
for v in ("spiel-ag", "spiel-ag-block", "spiel-ma-block"):
    cells = []
    for tree in ("old", "composed", "default"):
        ratios = [r["step_s_median"] / floor[r["batch_id"]] for r in rows(tree) if r["variant"] == v and r["batch_id"] in floor]
        cells.append(f"{tree} {statistics.median(ratios):.3f} [{' '.join(f'{x:.3f}' for x in ratios)}]" if ratios else f"{tree} -")
    print(f"{v:<16}" + "   ".join(cells))
PY
elif [ "$MODE" = w ]; then
  run 150 python3 -m pytest tests/test_gpu.py tests/test_triton_kernels.py -q -p no:cacheprovider -k "write_lane or default_training_pass"
  round=0
  while (( $(left) > 200 )); do  # (a round: 7 runs of ~30 s)
    round=$((round + 1))
    runs="spiel-ag-block spiel-ag-block:no-lane spiel-ma-block spiel-ma-block:no-lane spiel-ag-block-merge spiel-ma-block-merge"
    (( round % 2 == 0 )) && runs=$(echo $runs | tr ' ' '\n' | tac | tr '\n' ' ')
    for v in floor $runs; do
      name=${v%%:*}; extra=(); [ "$v" != "$name" ] && extra=(--no-write-lane)
      run 60 python3 benchmarks/bench_step.py --size tinyllama --variant "$name" "${extra[@]}" --batch-id "w$round" --out "$OUT/write-lane-rounds.jsonl"
    done
  done
  python3 - "$OUT/write-lane-rounds.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
floor = {r["batch_id"]: r["step_s_median"] for r in rows if r["variant"] == "floor"}
by = {}
for r in rows:
    if r["variant"] != "floor" and r["batch_id"] in floor:
        name = r["variant"] + ("" if r.get("write_lane", True) else ", no lane")
        by.setdefault(name, []).append(r["step_s_median"] / floor[r["batch_id"]])
print("median step × that round's floor (median over rounds; each round in brackets)")
for name, ratios in by.items():
    print(f"{name:<28}{statistics.median(ratios):.3f} [{' '.join(f'{x:.3f}' for x in ratios)}]")
PY
elif [ "$MODE" = c ]; then  # the default-settings goals at Llama-2-7B shapes: block rows, default and opt-in
  [ -n "${TESTS:-}" ] && run 120 python3 -m pytest tests/test_gpu.py tests/test_triton_kernels.py -q -p no:cacheprovider -k "$TESTS"
  run 570 python3 benchmarks/bench_step.py --size llama2-7b \
    --variants "${VARIANTS:-floor,floor-dw,spiel-ag-block,spiel-ag-block-merge,spiel-ma-block,spiel-ma-block-merge,spiel-ag,spiel-ag-merge}" \
    --batch-id speed-c-7b --out "$OUT/bench-7b.jsonl"
elif [ "$MODE" = s ]; then
  run 150 python3 -m pytest tests/test_triton_kernels.py -q -p no:cacheprovider -k "top_ or radix"
  run 120 python3 benchmarks/candidate_selection.py --size tinyllama --out "$OUT/candidate-selection.jsonl"
  run 240 python3 benchmarks/candidate_selection.py --size llama2-7b --out "$OUT/candidate-selection.jsonl"
elif [ "$MODE" = m ]; then
  run 150 python3 benchmarks/moe_step.py --out "$OUT/moe.jsonl"
  [ -f "$OUT/moe.jsonl" ] && python3 benchmarks/moe_step.py --table "$OUT/moe.jsonl"
else
  echo "unknown mode '$MODE': choose a, c, g, h, k, m, p, r, s, t or w"; exit 2
fi
echo "done after $(( $(date +%s) - START )) s"
