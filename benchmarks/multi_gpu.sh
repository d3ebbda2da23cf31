#!/bin/bash
# Produces BENCHMARKS.md, "Two and four GPUs" (same indices as one GPU, tokens/s, largest shape) on a machine with
# 2 GPUs (or 4: the queue file benchmarks/multi_gpu_x4.txt), from a queue of "name|command" lines, resuming where a
# previous call stopped (finished names in $STATE/done; logs and results under $STATE):
#   STATE=/tmp/mg DEADLINE=480 bash benchmarks/multi_gpu.sh [queue-file]
# The default queue: equivalence of 2 GPUs × 4 against 1 GPU × 8 under DDP, FSDP2, ZeRO-2 and ZeRO-3, Trainer +
# SpIELCallback under each accelerate config, tokens/s at TinyLlama and Llama-2-7B shapes on 1 and 2 GPUs, and
# the largest Llama shape that trains at 8 × 1024 tokens per step on 1 GPU and on 2 sharded.
# Needs peft (and deepspeed for ZeRO) importable and this repository on PYTHONPATH.
set -u
export STATE=${STATE:-/tmp/mg}
DEADLINE=${DEADLINE:-480}
START=$(date +%s)
mkdir -p "$STATE"
touch "$STATE/done"
RUN="python3 -m torch.distributed.run --standalone"
ACC="python3 -m accelerate.commands.launch"
EQ=benchmarks/multi_gpu_equivalence.py
TP="benchmarks/multi_gpu_throughput.py --out $STATE/throughput.jsonl"
export RUN ACC EQ TP  # (a queue file's lines may use them: benchmarks/multi_gpu_x4.txt)
queue() {
  cat <<EOF
eq-one|$RUN --nproc_per_node 1 $EQ run --growth ag ma ma-adamw --out $STATE/eq/one
eq-ddp|$RUN --nproc_per_node 2 $EQ run --out $STATE/eq/ddp
eq-fsdp2|$RUN --nproc_per_node 2 $EQ run --engine fsdp2 --out $STATE/eq/fsdp2
eq-zero2|$RUN --nproc_per_node 2 $EQ run --engine zero2 --growth ag ma-adamw --out $STATE/eq/zero2
eq-zero3|$RUN --nproc_per_node 2 $EQ run --engine zero3 --growth ag ma-adamw --out $STATE/eq/zero3
tr-ddp|$ACC --config_file integrations/accelerate_ddp.yaml benchmarks/trainer_engines.py --out $STATE/tr/ddp
tr-fsdp2|$ACC --config_file integrations/accelerate_fsdp2.yaml benchmarks/trainer_engines.py --out $STATE/tr/fsdp2
tr-zero2|$ACC --config_file integrations/accelerate_zero2.yaml benchmarks/trainer_engines.py --out $STATE/tr/zero2
tr-zero3|$ACC --config_file integrations/accelerate_zero3.yaml benchmarks/trainer_engines.py --out $STATE/tr/zero3
tr-sft-ddp|$ACC --config_file integrations/accelerate_ddp.yaml benchmarks/trainer_engines.py --sft --out $STATE/tr/sft-ddp
tr-sft-fsdp2|$ACC --config_file integrations/accelerate_fsdp2.yaml benchmarks/trainer_engines.py --sft --out $STATE/tr/sft-fsdp2
tr-sft-zero2|$ACC --config_file integrations/accelerate_zero2.yaml benchmarks/trainer_engines.py --sft --out $STATE/tr/sft-zero2
tr-sft-zero3|$ACC --config_file integrations/accelerate_zero3.yaml benchmarks/trainer_engines.py --sft --out $STATE/tr/sft-zero3
cli-fsdp2|python3 -c "from pathlib import Path; from tests.test_distributed import _tiny_recipe; _tiny_recipe(Path('$STATE/cli'), 'r', 'max_steps: 12, per_device_train_batch_size: 4')" && $ACC --config_file integrations/accelerate_fsdp2.yaml -m peft_sparse.cli train $STATE/cli/r.yaml --set training.use_cpu=false --set training.bf16=true
tp-tiny-one|CUDA_VISIBLE_DEVICES=0 $RUN --nproc_per_node 1 $TP --method spiel-ag --size tinyllama & CUDA_VISIBLE_DEVICES=1 $RUN --nproc_per_node 1 $TP --method lora --size tinyllama; wait; $RUN --nproc_per_node 1 $TP --method spiel-ma --size tinyllama
tp-tiny-ddp|for m in spiel-ag spiel-ma lora; do $RUN --nproc_per_node 2 $TP --engine ddp --method \$m --size tinyllama; done
tp-7b-one|CUDA_VISIBLE_DEVICES=0 $RUN --nproc_per_node 1 $TP --method spiel-ag --size llama2-7b & CUDA_VISIBLE_DEVICES=1 $RUN --nproc_per_node 1 $TP --method lora --size llama2-7b; wait; $RUN --nproc_per_node 1 $TP --method spiel-ma --size llama2-7b
tp-7b-ddp|for m in spiel-ag spiel-ma lora; do $RUN --nproc_per_node 2 $TP --engine ddp --method \$m --size llama2-7b; done
tp-sharded|for e in fsdp2 zero2 zero3; do $RUN --nproc_per_node 2 $TP --engine \$e --method spiel-ag --size tinyllama; done
big-one|for s in llama2-13b codellama-34b; do $RUN --nproc_per_node 1 $TP --method spiel-ag --size \$s --warmup 3 --steps 5; done
big-fsdp2|$RUN --nproc_per_node 2 $TP --engine fsdp2 --method spiel-ag --size codellama-34b --batch 4 --warmup 3 --steps 5
big-zero3|$RUN --nproc_per_node 2 $TP --engine zero3 --method spiel-ag --size codellama-34b --batch 4 --warmup 3 --steps 5
EOF
}
while IFS='|' read -r name cmd; do
  [[ -z "$name" || "$name" == \#* ]] && continue
  grep -qxF -- "$name" "$STATE/done" && continue
  (( $(date +%s) - START > DEADLINE )) && { echo "deadline: stopping before $name"; break; }
  echo "== $name"
  t0=$(date +%s)
  if bash -c "$cmd" > "$STATE/log-$name.txt" 2>&1; then
    echo "$name" >> "$STATE/done"; echo "ok $name ($(( $(date +%s) - t0 )) s)"
  else
    echo "FAILED $name ($(( $(date +%s) - t0 )) s)"; grep -v Warning "$STATE/log-$name.txt" | grep -E "Error|error" | tail -4
    echo "$name" >> "$STATE/done"
  fi
done < <(if [[ $# -gt 0 ]]; then cat "$1"; else queue; fi)
for d in "$STATE"/eq/*/; do [[ "$(basename "$d")" != one ]] && python3 $EQ compare "$STATE/eq/one" "$d" 2>/dev/null | head -2 | sed "s|^|$(basename "$d"): |"; done
for d in "$STATE"/tr/*/; do python3 benchmarks/compare_ranks.py "$d" 2>/dev/null; done
[[ -f $STATE/throughput.jsonl ]] && python3 benchmarks/multi_gpu_throughput.py table "$STATE/throughput.jsonl"
true
