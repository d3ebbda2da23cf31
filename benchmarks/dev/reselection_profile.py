"""Where a SpIEL reselection spends its time (host profile), uniform vs adaptive split, at SmolLM2-135M shapes with
random weights (no model file needed):  python benchmarks/dev/reselection_profile.py --device cuda [--split adaptive]"""

import argparse
import cProfile
import pstats
import time

import peft
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import peft_sparse

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cpu")
parser.add_argument("--split", default="adaptive")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--top", type=int, default=25)
args = parser.parse_args()
torch.manual_seed(0)
config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True)
model = LlamaForCausalLM(config).to(args.device)
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
spiel = peft_sparse.SpIELConfig(target_modules=targets, num_tunable_weights=4884480, budget_split=args.split, seed=0)
wrapped = peft.get_peft_model(model, spiel)
params = [p for p in wrapped.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=3.0)
scheduler = peft_sparse.SpIELScheduler(wrapped, opt, total_steps=150)
x = torch.randint(0, 49152, (8, 128), device=args.device)
prof = cProfile.Profile()
sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
step_s = []
for step in range(1, args.steps + 1):
    sync()
    t0 = time.perf_counter()
    wrapped(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    sync()
    t1 = time.perf_counter()
    profiled = step == 25
    if profiled:
        prof.enable()
    report = scheduler.step()
    sync()
    if profiled:
        prof.disable()
    t2 = time.perf_counter()
    step_s.append(t1 - t0)
    if report:
        print(f"step {step}: reselection {t2 - t1:.3f} s (previous step {step_s[-2] if len(step_s) > 1 else 0:.3f} s, this {t1 - t0:.3f} s)", flush=True)
print(f"split={args.split} median step {sorted(step_s)[len(step_s) // 2] * 1e3:.1f} ms")
pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
