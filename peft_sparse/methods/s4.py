"""S⁴-Tuning: language sub-networks (Xu et al., §3.2–3.3, §4.4), PEFT type ``"S4"``.

1. **Detection** (:func:`detect_language_masks`): for each language t, the gradient of its loss is
   accumulated over ``importance_batches`` batches of its data and every targeted weight h scored by Taylor
   importance Ω_t(h) = |∂L_t/∂h · h|; each tensor keeps its top fraction p (the same p for every language and
   tensor), ranked one tensor at a time.
2. **Representation** (:func:`build_s4_model`): one sparse delta over the union of the masks, and per layer
   one mask per language over the union's slots, stored as packed bits (``sparse_masks``).
3. **Training** (:class:`S4Router`): the forward pass uses the whole adapted network; a batch of language t
   updates only the slots in M_t — its gradient is masked and, around each optimizer step, every other slot's
   value and optimizer state are put back bit for bit (momentum cannot move them). The batch's language comes
   from the model call's ``language`` argument (a dataset column); **a mixed-language batch is refused**
   (use ``peft_sparse.data.SingleLanguageBatchSampler``).
4. **Analysis**: :func:`mask_overlaps` (Jaccard between languages), :func:`layer_fractions`.

The adapter saves, loads, merges and composes like every sparse adapter; ``merge_and_unload`` gives one
model for all languages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch
from peft import get_peft_model
from peft.utils import PeftType

from ..core import edit
from ..core.config import SparseConfig
from ..core.base import logical_shape, supported_base_layer
from ..core.experts import ParameterSlice, slice_names
from ..core.layer import SparseLayer
from ..core.selection import global_top_k, top_indices
from ..core.tuner import SparseTuner, initial_values, parameter_targets, resolve_default_targets, target_matches
from ..data import check_single_language
from ..optim.surgery import hold_slots, release_slots, unwrap_optimizer
from ..registry import ExcludedModule, include_all_linear_layers


@dataclass
class S4Config(SparseConfig):
    """S⁴-Tuning: ``density`` is p, the fraction of each targeted tensor in every language's mask."""

    languages: Optional[list] = field(default=None, metadata={"help": "The target languages, in the order of the masks."})
    importance_batches: int = field(default=4, metadata={"help": "Batches of each language's data whose gradients score the weights."})
    score_normalization: str = field(
        default="none",
        metadata={
            "help": (
                "'none' (the paper): rank by Ω = |∂L/∂h · h|. 'column': rank by Ω divided by the RMS of Ω over its input "
                "column, which spreads a mask over the columns instead of piling it into the few with the largest scores."
            )
        },
    )
    selection: str = field(
        default="per_tensor",
        metadata={
            "help": (
                "'per_tensor': each language keeps the top fraction p of every targeted tensor. 'global' (the paper's §3.2: "
                "p of all N parameters): the top p·N scores over all targeted tensors at once, found tensor by tensor."
            )
        },
    )
    min_shared: bool = field(default=False, metadata={"help": "Also keep in every mask the weights that every language selected (no-op by construction; recorded)."})

    init_choices = ("detected",)

    def __post_init__(self):
        if self.init == "random":
            self.init = "external"  # (the masks come from detection, then from the adapter file)
        super().__post_init__()
        self.peft_type = PeftType.S4
        if not self.languages or not isinstance(self.languages, (list, tuple)) or not all(isinstance(x, str) for x in self.languages):
            raise ValueError(f"languages must be a non-empty list of names, got languages={self.languages!r}")
        if len(set(self.languages)) != len(self.languages):
            raise ValueError(f"languages must be distinct, got languages={self.languages!r}")
        self.languages = list(self.languages)
        if self.density is None:
            raise ValueError("S4Config takes density (p, the fraction of each tensor in a language's mask), not num_tunable_weights")
        if isinstance(self.importance_batches, bool) or not isinstance(self.importance_batches, int) or self.importance_batches < 1:
            raise ValueError(f"importance_batches must be a positive integer, got importance_batches={self.importance_batches!r}")
        if self.score_normalization not in ("none", "column"):
            raise ValueError(f"score_normalization must be 'none' or 'column', got score_normalization={self.score_normalization!r}")
        if self.selection not in ("per_tensor", "global"):
            raise ValueError(f"selection must be 'per_tensor' or 'global', got selection={self.selection!r}")
        if tuple(self.block_shape) != (1, 1):
            raise ValueError(f"block_shape={self.block_shape!r}: S⁴ masks single weights; use (1, 1)")


class S4Model(SparseTuner):
    """PEFT tuner of :class:`S4Config`: the union's slots, and packed per-language masks, as placeholders until
    :func:`build_s4_model` or a saved adapter fills them."""

    prefix: str = "sparse_"

    def initial_indices(self, config, layer, module_name, count):  # pragma: no cover  (init is always 'external')
        raise RuntimeError("S⁴ indices come from detect_language_masks: use build_s4_model")

    def _create_and_replace(self, peft_config, adapter_name, target, target_name, parent, current_key, **kwargs):
        layers = super()._create_and_replace(peft_config, adapter_name, target, target_name, parent, current_key, **kwargs)
        for layer in layers:
            count = peft_config.tunable_weights_per_module[layer.module_name]
            values = layer.sparse_values[adapter_name]
            layer.sparse_masks[adapter_name] = torch.zeros(len(peft_config.languages), math.ceil(count / 8), dtype=torch.uint8, device=values.device)
        return layers


# ---------------------------------------------------------------------------------------------- bits
def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """(rows, n) bool → (rows, ⌈n/8⌉) uint8, bit i of byte j is element 8j + i."""
    rows, n = mask.shape
    padded = torch.zeros(rows, math.ceil(n / 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[:, :n] = mask.to(torch.uint8)
    weights = (2 ** torch.arange(8, device=mask.device)).to(torch.uint8)
    return (padded.view(rows, -1, 8) * weights).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: (rows, ⌈n/8⌉) uint8 → (rows, n) bool."""
    bits = (packed.unsqueeze(-1) >> torch.arange(8, device=packed.device, dtype=torch.uint8)) & 1
    return bits.reshape(packed.shape[0], -1)[:, :n].bool()


# ---------------------------------------------------------------------------------------------- detection
def _targets(model, config: S4Config) -> dict:
    resolve_default_targets(config, SparseTuner.get_model_config(model).get("model_type"))
    include_all_linear_layers(config, model)
    found = {}
    for key, module in model.named_modules():
        if key and target_matches(config, key) and not isinstance(target_matches(config, key), ExcludedModule):
            if not supported_base_layer(module):
                raise TypeError(f"target module {key!r} is a {type(module).__name__}, which S⁴ does not support")
            found[key] = module
    for key, owner, name in parameter_targets(config, model):  # (target_parameters: one tensor per expert)
        param = owner._parameters[name]
        for e, slice_name in enumerate(slice_names(key, param)):
            found[slice_name] = ParameterSlice(owner, name, e if param.dim() == 3 else None)
    if not found:
        raise ValueError(f"target_modules={config.target_modules!r} and target_parameters={config.target_parameters!r} match nothing in the model")
    return found


def _leaf(module) -> torch.Tensor:
    """The parameter whose gradient holds the target's: its weight, or the whole parameter an expert slice views."""
    return module.parameter() if isinstance(module, ParameterSlice) else module.weight


def _size(module) -> int:
    rows, cols = logical_shape(module)
    return rows * cols


def _importance(module, w: torch.Tensor, config: S4Config) -> torch.Tensor:
    """Ω = |∂L/∂h · h| of one tensor (Eq. 2), float32 on the CPU in logical (out, in) order, column-normalised if asked."""
    grad, w = w.grad, w.detach()
    if isinstance(module, ParameterSlice) and module.index is not None:  # (one expert of a fused tensor)
        grad, w = grad[module.index], w[module.index]
    score = (grad * w).abs()
    if type(module).__name__ == "Conv1D":
        score = score.t()  # (logical (out, in) order)
    if config.score_normalization == "column":  # Ω_ij / RMS_i(Ω_ij): every input column j on one scale
        score = score / score.float().pow(2).mean(0, keepdim=True).sqrt().clamp_min(torch.finfo(torch.float32).tiny)
    return score.float().cpu()


@torch.enable_grad()  # (the scores are gradients: detection works inside a caller's torch.no_grad() too)
def detect_language_masks(model, loaders: Mapping[str, object], config: S4Config) -> dict:
    """{language: {module name: sorted flat indices}}: each language's top-p weights by |∂L_t/∂h · h| (gradients
    accumulated over ``config.importance_batches`` batches of ``loaders[language]``, each a dict for ``model``)."""
    missing = [lang for lang in config.languages if lang not in loaders]
    if missing:
        raise ValueError(f"no data for languages {missing}: detect_language_masks needs a loader per language")
    targets = _targets(model, config)
    weights = {k: _leaf(m) for k, m in targets.items()}
    was = {k: w.requires_grad for k, w in weights.items()}
    training = model.training
    model.eval()  # (no dropout in the scores)
    masks = {}
    try:
        for w in weights.values():
            w.requires_grad_(True)
        for lang in config.languages:
            for w in weights.values():
                w.grad = None
            seen = 0
            for batch in loaders[lang]:
                if seen == config.importance_batches:
                    break
                model(**batch).loss.backward()
                seen += 1
            if seen == 0:
                raise ValueError(f"language {lang!r} has no data: its loader yielded no batch")
            scores = {key: (lambda key=key: _importance(targets[key], weights[key], config).reshape(-1)) for key in targets}
            if config.selection == "global":  # p of all the targeted weights, one tensor's scores in memory at a time
                total = sum(_size(m) for m in targets.values())
                masks[lang] = global_top_k(scores, round(config.density * total))
            else:
                masks[lang] = {key: top_indices(score(), round(config.density * _size(targets[key]))) for key, score in scores.items()}
            for w in weights.values():
                w.grad = None
    finally:
        for k, w in weights.items():
            w.requires_grad_(was[k])
            w.grad = None
        model.train(training)
    return masks


def build_s4_model(model, config: S4Config, masks: Mapping[str, Mapping[str, torch.Tensor]], adapter_name: str = "default"):
    """A PEFT model whose adapter holds the union of the languages' masks and the packed masks (values 0, or drawn
    from torch's generator with ``init_weights=False``)."""
    unknown = [lang for lang in masks if lang not in config.languages]
    missing = [lang for lang in config.languages if lang not in masks]
    if unknown or missing:
        raise ValueError(f"masks for languages {sorted(masks)} do not match config.languages={config.languages}")
    targets = _targets(model, config)
    union, shapes = {}, {}
    for key, module in targets.items():
        out_f, in_f = logical_shape(module)
        for lang in config.languages:
            if key not in masks[lang]:
                raise ValueError(f"the masks hold nothing for module {key!r} (detected on another model?)")
            idx = torch.as_tensor(masks[lang][key])
            if idx.numel() and int(idx.max()) >= out_f * in_f:
                raise ValueError(f"{key}: mask index {int(idx.max())} is outside its ({out_f}, {in_f}) weight (detected on another model?)")
        union[key] = torch.unique(torch.cat([torch.as_tensor(masks[lang][key]).long() for lang in config.languages]))
        shapes[key] = [out_f, in_f]
    extra = sorted({k for lang in config.languages for k in masks[lang]} - set(targets))
    if extra:
        raise ValueError(f"the masks name modules the model does not target: {extra[:3]} (detected on another model?)")
    config.tunable_weights_per_module = {k: int(v.numel()) for k, v in union.items()}
    config.module_shapes = shapes
    config.init = "external"
    peft_model = get_peft_model(model, config, adapter_name=adapter_name)
    names = {layer.module_name: layer for layer in peft_model.modules() if isinstance(layer, SparseLayer)}
    # values 0, or random draws with init_weights=False (as every sparse config's), in module order
    values = {k: initial_values(config, union[k].numel()) for k in names}
    edit.set_indices(peft_model, {k: union[k] for k in names}, values=values, adapter_name=adapter_name)
    for key, layer in names.items():
        rows = torch.stack([torch.isin(union[key], torch.as_tensor(masks[lang][key]).long()) for lang in config.languages])
        layer.sparse_masks[adapter_name] = pack_bits(rows).to(layer.sparse_indices[adapter_name].device)
    return peft_model


def language_masks(model, adapter_name: str = "default") -> dict:
    """{module: (languages, slots) bool} of an S⁴ adapter."""
    return {m.module_name: unpack_bits(m.sparse_masks[adapter_name], m.sparse_values[adapter_name].numel())
            for m in model.modules() if isinstance(m, SparseLayer) and adapter_name in m.sparse_masks}  # fmt: skip


# ---------------------------------------------------------------------------------------------- training
class S4Router:
    """Routes each batch to its language's sub-network: call the model with ``language=[name per row]``
    (all the same). Gradients outside M_t are zeroed, and the values and optimizer state outside M_t are put
    back after each optimizer step, bit for bit."""

    def __init__(self, model, optimizer, adapter_name: str = "default", column: str = "language"):
        self.model, self.adapter_name, self.column = model, adapter_name, column
        self.config = model.peft_config[adapter_name]
        self.layers = [m for m in model.modules() if isinstance(m, SparseLayer) and adapter_name in m.sparse_masks]
        self.masks = [unpack_bits(m.sparse_masks[adapter_name], m.sparse_values[adapter_name].numel()) for m in self.layers]
        self.optimizer = optimizer = unwrap_optimizer(optimizer)
        self.current: Optional[int] = None
        self._saved: list = []
        self._handles = [
            model.register_forward_pre_hook(self._route, with_kwargs=True),
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    def _route(self, module, args, kwargs):
        if self.column not in kwargs:
            raise ValueError(f"S4Router: the model call has no {self.column!r} argument naming the batch's language")
        names = kwargs.pop(self.column)
        language = check_single_language([names] if isinstance(names, str) else list(names))
        if language not in self.config.languages:
            raise KeyError(f"S4Router: language {language!r} has no mask; the adapter's languages are {self.config.languages}")
        self.current = self.config.languages.index(language)
        return args, kwargs

    def _before_step(self, optimizer, args, kwargs):
        if self.current is None:
            raise RuntimeError("S4Router: an optimizer step before any routed forward pass")
        params = [layer.sparse_values[self.adapter_name] for layer in self.layers]
        outside = [~mask[self.current].to(values.device) for mask, values in zip(self.masks, params)]
        self._saved = hold_slots(optimizer, params, outside)

    def _after_step(self, optimizer, args, kwargs):
        release_slots(optimizer, self._saved)
        self._saved = []

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


# ---------------------------------------------------------------------------------------------- analysis
def mask_overlaps(model, adapter_name: str = "default") -> dict:
    """{(a, b): Jaccard |M_a ∩ M_b| / |M_a ∪ M_b|} over all targeted weights, for every pair of languages."""
    return jaccard(model.peft_config[adapter_name].languages, list(language_masks(model, adapter_name).values()))


def jaccard(languages: list, masks: list) -> dict:
    """Pairwise Jaccard overlaps of per-module (languages, slots) bool masks, summed over the modules."""
    out = {}
    for i, a in enumerate(languages):
        for j, b in enumerate(languages):
            inter = sum(int((m[i] & m[j]).sum()) for m in masks)
            union = sum(int((m[i] | m[j]).sum()) for m in masks)
            out[(a, b)] = inter / union if union else 1.0
    return out


def file_overlaps(adapter_dir) -> tuple[list, dict]:
    """(languages, Jaccard overlaps) of a saved S⁴ adapter, from its files alone."""
    from ..core.compose import adapter_file_summary
    from ..core.config import read_adapter_config

    raw = read_adapter_config(adapter_dir)
    if raw.get("peft_type") != "S4":
        raise ValueError(f"{adapter_dir} holds a {raw.get('peft_type')} adapter; mask overlaps need an S4 adapter")
    tensors = adapter_file_summary(adapter_dir)["tensors"]
    masks = [unpack_bits(t, tensors[k.replace(".sparse_masks", ".sparse_values")].numel()) for k, t in tensors.items() if k.endswith(".sparse_masks")]
    return raw["languages"], jaccard(raw["languages"], masks)


def overlap_table(languages: list, overlaps: dict) -> str:
    """The overlaps as a text table (rows and columns in language order)."""
    lines = ["        " + "".join(f"{b:>8}" for b in languages)]
    lines += [f"{a:<8}" + "".join(f"{overlaps[(a, b)]:>8.3f}" for b in languages) for a in languages]
    return "\n".join(lines)


def layer_fractions(model, adapter_name: str = "default") -> dict:
    """{module: {language: fraction of the module's weights in the language's mask}}."""
    languages = model.peft_config[adapter_name].languages
    layers = {m.module_name: m for m in model.modules() if isinstance(m, SparseLayer)}
    return {k: {lang: int(m[i].sum()) / layers[k].numel for i, lang in enumerate(languages)} for k, m in language_masks(model, adapter_name).items()}
