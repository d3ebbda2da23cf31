"""Where a transformer's blocks and their feed-forward outputs are, found from the model itself.

Blocks: the longest ``nn.ModuleList`` of identical modules with parameters (``model.layers`` in Llama,
``transformer.h`` in GPT-2, ``encoder.layer`` in BERT/XLM-R). A module belongs to attention when a component
of its path inside the block contains "attn" or "attention". The feed-forward output of a block is its one
linear map (``nn.Linear`` or GPT-2's ``Conv1D``) outside attention that narrows its input (in > out): Llama
``mlp.down_proj``, GPT-2 ``mlp.c_proj``, BERT/XLM-R ``output.dense``.
"""

from __future__ import annotations

from torch import nn


def find_blocks(model: nn.Module) -> tuple[str, int]:
    """(name prefix, count) of the model's transformer blocks: the longest ModuleList of same-class modules."""
    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            kinds = {type(m) for m in module}
            if len(kinds) == 1 and any(True for _ in module[0].parameters()):
                if best is None or len(module) > best[1]:
                    best = (name, len(module))
    if best is None:
        raise ValueError("the model's transformer blocks were not found (no nn.ModuleList of identical modules with parameters)")
    return best


def is_attention_path(path: str) -> bool:
    return any("attn" in p or "attention" in p for p in path.lower().split("."))


def in_out_features(module: nn.Module):
    """(in, out) of an ``nn.Linear`` or a GPT-2 ``Conv1D`` (weight stored (in, out)); None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None and module.weight.dim() == 2:
        return tuple(module.weight.shape)
    return None


def find_ffn_outputs(model: nn.Module) -> list[str]:
    """Full names of every block's feed-forward output module, in block order (module docstring)."""
    prefix, count = find_blocks(model)
    blocks = model.get_submodule(prefix)
    out = []
    for i, block in enumerate(blocks):
        hits = []
        for path, module in block.named_modules():
            if not path or is_attention_path(path):
                continue
            base = getattr(module, "base_layer", None)  # an already-wrapped PEFT layer keeps its base
            shape = in_out_features(base if base is not None else module)
            if shape is not None and shape[0] > shape[1] and not any(path.startswith(h + ".") for h in hits):
                hits.append(path)
        if len(hits) != 1:
            raise ValueError(
                f"block {prefix}.{i} has {len(hits)} candidate feed-forward outputs ({hits}); name the modules with "
                "target_modules=[...]"
            )
        out.append(f"{prefix}.{i}.{hits[0]}" if prefix else f"{i}.{hits[0]}")
    return out
