"""Host time of a training forward pass with TinyLlama's 22 layers and 7 targeted projections, and what
parts of a sparse layer's steady pass add to it.

    python benchmarks/host_forward.py [--device cuda] [--rounds 30] [--tokens 128] [--hidden 256]

The model is narrow (``--hidden``) and the batch short (``--tokens``), so each kernel is short and a
forward pass's time is the host's. SpIEL-MA (SM3) trains a few steps first, so that every layer's pass is
a steady one. Then forward passes are timed with the device idle at their start, the configurations
interleaved round by round (a host's speed drifts):

* ``floor`` — the frozen model, input gradients only;
* ``spiel-ma`` — as it runs;
* ``no-observer`` — the layers' training observer (the unscheduled-training guard) removed;
* ``keep-inputs`` — ``rebuild_inputs="none"``: X is saved for backward, no rebuild record;
* ``generic-forward`` — the steady pass through the generic autograd function, not ``MergedDeltaLinear``.

It prints each configuration's median forward time and, for the sparse ones, the time per sparse layer
call over the floor's (the floor runs the same projections as plain ``nn.Linear`` calls). On a CPU
(``--device cpu``) it measures Python and dispatch without kernel launches.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # benchmarks/ and the repository

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(sparse: bool, hidden: int, device: str, block: int = 1):
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import peft_sparse

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=22, num_attention_heads=8,
                      num_key_value_heads=1, vocab_size=1024, tie_word_embeddings=False)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
    model.config.use_cache = False
    for p in model.parameters():
        p.requires_grad_(False)
    if not sparse:
        model.enable_input_require_grads()
        return model, None, None
    model = get_peft_model(model, peft_sparse.SpIELConfig(target_modules=TARGETS, density=0.05, growth="ma", block_shape=(block, block)))
    optimizer = peft_sparse.SM3([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    scheduler = peft_sparse.SpIELScheduler(model, optimizer, total_steps=10_000)
    scheduler.t = 100  # steady steps: no window, no reselection
    scheduler._disarm()
    return model, optimizer, scheduler  # (the scheduler kept alive: the guard stays quiet)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--block", type=int, default=1, help="square block side of the sparse layers (1: unstructured)")
    args = parser.parse_args()
    from peft_sparse.core import functional
    from peft_sparse.core import layer as layer_module

    device = args.device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    ids = torch.randint(0, 1024, (1, args.tokens), device=device)
    floor, _, _ = build(False, args.hidden, device)
    model, optimizer, scheduler = build(True, args.hidden, device, args.block)
    floor.train()
    model.train()
    for _ in range(3):  # every layer merged in place and rewritten by the step hook: steady passes
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    layers = [m for m in model.modules() if isinstance(m, layer_module.SparseLayer)]
    observers = [layer.training_observer for layer in layers]

    def no_observer(on: bool):
        for layer, observer in zip(layers, observers):
            layer.training_observer = None if on else observer

    def keep_inputs(on: bool):
        for layer in layers:
            layer.rebuild_inputs = "none" if on else "all"

    def generic_forward(on: bool):
        layer_module.merged_apply = functional.sparse_delta_apply if on else functional.merged_apply

    configs = {"floor": (floor, None), "spiel-ma": (model, None), "no-observer": (model, no_observer),
               "keep-inputs": (model, keep_inputs), "generic-forward": (model, generic_forward)}  # fmt: skip
    times = {name: [] for name in configs}
    for r in range(args.rounds + 1):
        for name, (net, toggle) in configs.items():
            if toggle is not None:
                toggle(True)
            sync()
            start = time.perf_counter()
            loss = net(input_ids=ids, labels=ids).loss
            elapsed = time.perf_counter() - start
            if net is model:
                assert all(layer._steady is not None for layer in layers), "a sparse pass was not steady"
            del loss
            sync()
            if toggle is not None:
                toggle(False)
            if r:  # (the first round warms up)
                times[name].append(elapsed)
    where = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"
    print(f"{where}: forward host time, median of {args.rounds} interleaved rounds, {len(layers)} sparse layers, "
          f"{args.tokens} tokens, hidden {args.hidden}, blocks {args.block}×{args.block}")  # fmt: skip
    floor_ms = statistics.median(times["floor"]) * 1e3
    for name, values in times.items():
        ms = statistics.median(values) * 1e3
        extra = f"  {(ms - floor_ms) / len(layers) * 1e3:6.1f} µs per sparse layer call over the floor" if name != "floor" else ""
        print(f"  {name:<16} {ms:7.2f} ms{extra}", flush=True)


if __name__ == "__main__":
    main()
