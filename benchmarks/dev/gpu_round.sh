#!/usr/bin/env bash
# On the GPU machine: `bash benchmarks/dev/gpu_round.sh tests` (the GPU-touching test files and the decode
# benchmark) or `... bench` (step times of the floor and the SpIEL variants: the code before the training
# merge became opt-in (.old/, carried), today's default, and today's --training-merge, back to back).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PEFT_SPARSE_CACHE=/tmp/psc HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "$1" in
tests)
  python3 -m pytest -q -m "not slow" -p no:cacheprovider tests/test_gpu.py tests/test_triton_kernels.py tests/test_steady_steps.py \
    tests/test_quantized.py tests/test_inference.py tests/test_internals.py tests/test_training_merge.py tests/test_edit.py 2>&1 | tail -15
  python3 benchmarks/decode.py --device cuda --size tinyllama 2>&1 | grep -v "^Failed to load" | tail -20
  ;;
bench)
  V=${V:-floor,spiel-ag,spiel-ma,spiel-ag-block,spiel-ma-block}
  python3 benchmarks/bench_step.py --variants $V --settle 20 --out $OUT/default.jsonl 2>&1 | grep -v "^Failed to load" | tail -12
  python3 benchmarks/bench_step.py --variants $V --training-merge --out $OUT/merge.jsonl 2>&1 | grep -v "^Failed to load" | tail -12
  (cd .old && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/bench_step.py --variants $V --out $OUT/old.jsonl 2>&1 | grep -v "^Failed to load" | tail -12)
  ;;
esac
