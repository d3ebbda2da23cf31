#!/bin/bash
# `peft-sparse train` under an accelerate config on 2 GPUs: an uninterrupted 12-step run writing checkpoint-5 (S = 4,
# γ = 2: reselections at 2, 6, 10, so the checkpoint falls inside the window of the one at 6), a run resumed from
# it, and one process at the same global batch; the adapters compared (indices equal, values within the ZeRO tests'
# tolerance), and the scores printed (a sharded run is scored from the adapter reloaded on the first process).
#   STATE=/tmp/cr bash benchmarks/dev/cli_resume_check.sh integrations/accelerate_fsdp2.yaml
set -eu
CONFIG=$1
STATE=${STATE:-/tmp/cr}
ACC="python3 -m accelerate.commands.launch"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
recipe() { python3 -c "import sys; from pathlib import Path; from tests.test_distributed import _tiny_recipe; _tiny_recipe(Path(sys.argv[1]), *sys.argv[2:])" "$STATE" "$1" "$2"; }
recipe whole "max_steps: 12, per_device_train_batch_size: 4, save_strategy: steps, save_steps: 5"
recipe resumed "max_steps: 12, per_device_train_batch_size: 4, save_strategy: 'no', resume_from_checkpoint: $STATE/whole/checkpoint-5"
recipe one "max_steps: 12, per_device_train_batch_size: 8, save_strategy: 'no'"
$ACC --config_file "$CONFIG" -m peft_sparse.cli train "$STATE/whole.yaml" --set training.use_cpu=false | grep -E "exact match|saved"
$ACC --config_file "$CONFIG" -m peft_sparse.cli train "$STATE/resumed.yaml" --set training.use_cpu=false | grep -E "exact match|saved"
CUDA_VISIBLE_DEVICES=0 python3 -m peft_sparse.cli train "$STATE/one.yaml" --set training.use_cpu=false | grep -E "exact match|saved"
python3 - "$STATE" <<'PY'
import json, sys
from pathlib import Path
from tests.test_deepspeed import _assert_same_adapter
state = Path(sys.argv[1])
for a, b in (("whole", "resumed"), ("whole", "one")):
    try:
        _assert_same_adapter(state / a, state / b)
        print(f"{a} vs {b}: same indices, values within tolerance")
    except AssertionError as e:
        print(f"{a} vs {b}: DIFFER: {str(e)[:300]}")
for n in ("whole", "resumed", "one"):
    s = json.loads((state / n / "summary.json").read_text())
    print(n, s["world_size"], s["engine"], s["reselection_steps"], "after:", s["after"] and s["after"]["accuracy"])
PY
