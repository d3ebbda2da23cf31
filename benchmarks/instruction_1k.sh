#!/bin/bash
# Produces BENCHMARKS.md, "Quality": the table "1,000 steps through peft-sparse train".
# SpIEL-AG (recipes/smollm2_spiel.yaml) beside PEFT LoRA r16 (recipes/smollm2_lora.yaml) and the fixed random mask
# (recipes/smollm2_sft.yaml) for 1,000 steps through `peft-sparse train` (TRL's SFTTrainer) on both bundled
# instruction sets, several seeds, on one GPU: held-out exact match before/after, final training loss and training
# time, one JSON line per run in $RESULTS.
#   RESULTS=benchmarks/results/instruction-1k.jsonl PARALLEL=8 DEADLINE=300 bash benchmarks/instruction_1k.sh
# (peft_sparse importable: installed, or PYTHONPATH=$PWD; the model converted once into PEFT_SPARSE_CACHE)
# The recipes run at the same trainable count, batch 8, linear decay after 3% warmup, float32; SpIEL at S, γ 'auto'
# (133 and 33 at 1,000 steps: docs/spiel.md); SPIEL_S=20 SPIEL_GAMMA=5 for the paper's fixed counts. Runs share the
# GPU PARALLEL at a time, so compare the methods' times within one call, not across calls.
set -u
STEPS=${STEPS:-1000}
SEEDS=${SEEDS:-"0 1 2"}
TASKS=${TASKS:-"skills skills2"}
METHODS=${METHODS:-"spiel lora sft"}
PARALLEL=${PARALLEL:-4}
DEADLINE=${DEADLINE:-100000}   # seconds from the start: launch no run after this (a call with a time limit)
WORK=${WORK:-/tmp/instruction-1k}
RESULTS=${RESULTS:-$WORK/results.jsonl}
DEVICE_FLAGS=${DEVICE_FLAGS:-"--set training.use_cpu=false"}
SPIEL_S=${SPIEL_S:-auto}
SPIEL_GAMMA=${SPIEL_GAMMA:-auto}
SPIEL_FLAGS=${SPIEL_FLAGS:-}   # more overrides for SpIEL's runs only, e.g. "--set training.weight_decay=1.0"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}   # parallel runs: a few threads each, not every core each
mkdir -p "$WORK"
# convert the GGUF file into the cache once, before parallel runs race to write it
python3 -c "from peft_sparse.assets import load_model_and_tokenizer as load; load('smollm2-135m-instruct')" > /dev/null 2>&1
run_one() {
  local method=$1 task=$2 seed=$3 dir="$WORK/$1-$2-$3"
  (( $(date +%s) - START > DEADLINE )) && { echo "skipped $method $task $seed (deadline)"; return 0; }
  local extra=""
  [[ $method == spiel ]] && extra="--set method.reselection_steps=$SPIEL_S --set method.gradient_estimation_steps=$SPIEL_GAMMA --set method.seed=$seed $SPIEL_FLAGS"
  # shellcheck disable=SC2086
  python3 -m peft_sparse.cli train "recipes/smollm2_$method.yaml" $DEVICE_FLAGS $extra \
    --set training.max_steps="$STEPS" --set training.warmup_steps="$(( (STEPS * 3 + 99) / 100 ))" \
    --set training.seed="$seed" --set training.logging_steps=50 --set training.output_dir="$dir" \
    --set data.train="data/${task}_train.jsonl" --set data.eval="data/${task}_test.jsonl" > "$dir.log" 2>&1 \
    || { echo "FAILED $method $task $seed"; tail -5 "$dir.log"; return 0; }
  python3 - "$dir/summary.json" "$method" "$task" "$seed" "$STEPS" >> "$RESULTS" <<'PY'
import json, sys, torch
s = json.load(open(sys.argv[1]))
row = {"method": sys.argv[2], "task": sys.argv[3], "seed": int(sys.argv[4]), "steps": int(sys.argv[5]),
       "before": s["before"]["accuracy"], "after": s["after"]["accuracy"], "per_skill": s["after"]["per_skill"],
       "train_loss_last": s["train_loss_last"], "train_runtime_s": s["train_runtime_s"],
       "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
print(json.dumps(row))
PY
  echo "ok $method $task $seed"
}
export -f run_one
export STEPS WORK RESULTS DEVICE_FLAGS DEADLINE SPIEL_S SPIEL_GAMMA SPIEL_FLAGS
export START=$(date +%s)
for seed in $SEEDS; do for task in $TASKS; do for method in $METHODS; do echo "$method $task $seed"; done; done; done \
  | xargs -P "$PARALLEL" -L 1 bash -c 'run_one "$@"' _
