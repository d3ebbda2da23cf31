#!/usr/bin/env bash
# On the GPU machine: install the carried wheels, check versions and the PeftType extension on this
# Python, run the test suite (gpu tests included, compiled Triton kernels), then the value-gradient sweep
# (benchmarks/value_grad.py: its table, crossover and kernel rates; it appends its records under benchmarks/results).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PEFT_SPARSE_CACHE=/tmp/psc HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 - <<'PY'
import sys, torch, triton, transformers, peft, trl, bitsandbytes
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__, "peft", peft.__version__, "trl", trl.__version__, "bnb", bitsandbytes.__version__)
import peft_sparse
from peft.utils import PeftType
from peft import PeftConfig
print("PeftType extension on this Python:", PeftType("SFT"), PeftType.SPIEL, "SFT" in [t.value for t in PeftType])
PY
python3 -m pytest -q -m "not slow" -p no:cacheprovider tests "$@" 2>&1 | tail -5
python3 benchmarks/value_grad.py 2>&1 | grep -v "^Failed to load"
