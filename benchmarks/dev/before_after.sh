#!/usr/bin/env bash
# bench_step.py for the SpIEL variants (and their floors) on the code at .before/ (an earlier commit, e.g.
# `git archive 570634f^ | tar -x -C .before`) and on this tree, variant by variant, interleaved, on one GPU:
#   VARIANTS="floor spiel-ag" OUT=/tmp/ba bash benchmarks/dev/before_after.sh
# This tree runs with --training-merge (the merge was on by default before it became opt-in); BEFORE_MERGE=1
# passes it to .before too (a commit that already had the flag). ROUNDS=n gives bench_step.py --rounds n (interleaved
# rounds, full-cycle means); FLAGS are passed to both sides. Needs the peft, trl and bitsandbytes wheels in .whl/.
set -uo pipefail
OUT=${OUT:-/tmp/before-after}
ROUNDS=${ROUNDS:-1}
FLAGS=${FLAGS:-}
mkdir -p "$OUT" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export HF_HUB_OFFLINE=1
for v in ${VARIANTS:-floor spiel-ag spiel-ma spiel-ag-block spiel-ma-block qfloor qspiel-ag qspiel-ma}; do
  merge=""; [[ "$v" == *spiel* ]] && merge="--training-merge"
  before_merge=""; [[ "${BEFORE_MERGE:-0}" == 1 ]] && before_merge=$merge
  # shellcheck disable=SC2086
  (cd .before && PYTHONPATH=/tmp/site:$PWD timeout $((150 * ROUNDS)) python3 benchmarks/bench_step.py --variants "$v" $before_merge \
      --rounds "$ROUNDS" $FLAGS --batch-id before --out "$OUT/before.jsonl" 2>&1 | grep -v "^Failed to load" | tail -3)
  # shellcheck disable=SC2086
  PYTHONPATH=/tmp/site:$PWD timeout $((150 * ROUNDS)) python3 benchmarks/bench_step.py --variants "$v" $merge \
      --rounds "$ROUNDS" $FLAGS --batch-id after --out "$OUT/after.jsonl" 2>&1 | grep -v "^Failed to load" | tail -3
done
