"""Cross-lingual transfer with composable sparse adapters (thesis §4.3.2, Algorithm 1; multi-source §4.4.4).

Sparse adapters add: θ + φ_task + φ_lang. So a task adapter is trained *under* a frozen language
adapter simply by keeping both active — the forward pass adds both deltas, only the task's values
are trainable, and the task adapter ends up holding φ_task = θ′ − (θ + φ_src) by construction (no
subtraction, no weight copy). At inference the target language's adapter replaces the source's.

    model = get_peft_model(base, LTSFTConfig(...), adapter_name="task")
    add_frozen_adapter(model, "sft-en", "en")                 # the source language, frozen
    stack(model, under=["en"], trainable="task")              # train: θ + φ_en + φ_task
    ...
    model = compose(base, ["sft-sw", "task-adapter"])          # zero-shot: θ + φ_sw + φ_task (one adapter)

Multi-source training: every batch comes from one language (``peft_sparse.data.SingleLanguageBatchSampler``)
and :class:`LanguageSwitch` applies that language's adapter under the task adapter for the step: it
reads the batch's language column from the model call, so it works in a plain loop and in a Trainer
(keep the column: ``remove_unused_columns=False`` and a collator that passes it as a list of names).
Switching costs O(d_φ): the language deltas are added in the forward pass, the weights never copied.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Mapping, Optional, Sequence, Union

import torch
from peft import PeftModel

from .core.compose import load_sparse_adapter
from .core.layer import SparseLayer
from .data import check_single_language

PathLike = Union[str, os.PathLike]


def _names(model) -> set:
    return set(getattr(model, "peft_config", {})) | {a for m in model.modules() if isinstance(m, SparseLayer) for a in m.sparse_values}


def _base_name(path) -> str:
    from .assets import portable_base_model

    path = portable_base_model(path)  # (the built-in model by its name, wherever its folder is)
    return os.path.basename(str(path).rstrip("/\\")) if path else ""


def check_same_base(model: PeftModel, adapter_dir: PathLike) -> None:
    """Refuse an adapter made for another base model: a different recorded base model, or (bottleneck adapters) a
    module the model lacks or of another width."""
    from .core.config import read_adapter_config

    saved = read_adapter_config(adapter_dir)
    ours = next(iter(model.peft_config.values())).base_model_name_or_path if model.peft_config else None
    theirs = saved.get("base_model_name_or_path")
    if ours and theirs and _base_name(ours) != _base_name(theirs):
        raise ValueError(f"{adapter_dir!s} was made for base model {theirs!r}, but this model is {ours!r}")
    if saved.get("peft_type") == "BOTTLENECK":
        from safetensors import safe_open

        from .core.blocks import in_out_features
        from .core.storage import reading, weights_path

        base = model.get_base_model()
        path = weights_path(adapter_dir)
        with reading(path), safe_open(path, "pt") as f:
            for key in f.keys():
                if key.endswith("bottleneck_down.weight"):
                    name = key.removeprefix("base_model.model.").removesuffix(".bottleneck_down.weight")
                    try:
                        module = base.get_submodule(name)
                    except AttributeError:
                        raise ValueError(f"{adapter_dir!s} was made for another base model: this model has no module {name!r}") from None
                    width = in_out_features(getattr(module, "base_layer", module))[1]
                    if f.get_slice(key).get_shape()[1] != width:
                        raise ValueError(
                            f"{adapter_dir!s} was made for another base model: its adapter at {name!r} is "
                            f"{f.get_slice(key).get_shape()[1]} wide, the module's output here is {width}"
                        )


@contextmanager
def _keeping_trainability(model):
    """Restore every parameter's ``requires_grad`` as it was on entry: re-activating adapters (PEFT's
    ``set_adapter``) makes every active adapter trainable, a frozen language under a task included."""
    before = {id(p): p.requires_grad for p in model.parameters()}
    try:
        yield
    finally:
        for p in model.parameters():
            if id(p) in before:
                p.requires_grad_(before[id(p)])


def add_frozen_adapter(model: PeftModel, adapter_dir: PathLike, adapter_name: str) -> PeftModel:
    """Load a saved adapter beside the model's adapters, frozen; the active adapters are unchanged. Sparse adapters
    (any sparse method) join a sparse model, ``BOTTLENECK`` adapters (e.g. MAD-G's generated language adapters) a
    bottleneck model. No other adapter's trainability changes: a language adapter frozen under a task by
    :func:`stack` stays frozen when another language is added."""
    from .core.config import read_adapter_config

    if adapter_name in _names(model):
        raise ValueError(f"the model already holds an adapter named {adapter_name!r}")
    check_same_base(model, adapter_dir)
    active = model.active_adapters
    with _keeping_trainability(model):
        if read_adapter_config(adapter_dir).get("peft_type") == "BOTTLENECK":
            model.load_adapter(str(adapter_dir), adapter_name=adapter_name, is_trainable=False)
        else:
            load_sparse_adapter(model, adapter_dir, adapter_name=adapter_name, is_trainable=False)
        model.base_model.set_adapter(active if len(active) > 1 else active[0])
    model.base_model.set_requires_grad(adapter_name, False)
    return model


def stack(model: PeftModel, under: Sequence[str], trainable: Optional[str]) -> None:
    """Make ``under`` (frozen) and ``trainable`` the active adapters: the forward pass adds all their deltas
    (sparse adapters) or runs them in order, ``under`` first (bottleneck adapters: MAD-X ``Stack``); gradients
    reach only ``trainable`` (None: everything frozen, e.g. for evaluation)."""
    under = [under] if isinstance(under, str) else list(under)
    names = _names(model)
    unknown = [n for n in [*under, trainable] if n is not None and n not in names]
    if unknown:
        raise KeyError(f"stack: no adapter named {unknown[0]!r}; the model holds {sorted(names)}")
    if trainable in under:
        raise ValueError(f"stack: {trainable!r} cannot be both frozen (under) and trainable")
    active = [*under] + ([trainable] if trainable is not None else [])
    model.base_model.set_adapter(active if len(active) > 1 else active[0])
    model.base_model.set_requires_grad(under, False) if under else None
    if trainable is not None:
        model.base_model.set_requires_grad(trainable, True)


class LanguageSwitch:
    """Multi-source training: before each forward pass of ``model``, apply the language adapter of the batch's
    language (the ``column`` keyword of the call, removed before the model sees it) under ``task``.

    ``languages`` maps a language name (as in the column) to the name of its loaded, frozen adapter. A batch
    mixing languages, or naming one without an adapter, is refused."""

    def __init__(self, model: PeftModel, languages: Mapping[str, str], task: str, column: str = "language"):
        names = _names(model)
        unknown = [a for a in [*languages.values(), task] if a not in names]
        if unknown:
            raise KeyError(f"LanguageSwitch: no adapter named {unknown[0]!r}; the model holds {sorted(names)}")
        self.model, self.languages, self.task, self.column = model, dict(languages), task, column
        self.current: Optional[str] = None
        self._handle = model.register_forward_pre_hook(self._before, with_kwargs=True)

    def _before(self, module, args, kwargs):
        if self.column not in kwargs:
            raise ValueError(f"LanguageSwitch: the model call has no {self.column!r} argument naming the batch's language")
        names = kwargs.pop(self.column)
        if isinstance(names, str):
            names = [names]
        language = check_single_language(list(names))
        if language not in self.languages:
            raise KeyError(f"LanguageSwitch: no adapter for language {language!r}; known: {sorted(self.languages)}")
        if language != self.current:
            stack(self.model, [self.languages[language]], self.task)
            self.current = language
        return args, kwargs

    def remove(self) -> None:
        self._handle.remove()


def compose(base_model: torch.nn.Module, adapter_dirs: Sequence[PathLike], weights: Optional[Sequence[float]] = None,
            adapter_name: str = "composed") -> PeftModel:  # fmt: skip
    """θ + Σ wᵢ·φᵢ of saved sparse adapters (any sparse methods, e.g. a target-language SFT and a task SFT) as
    one active adapter ``adapter_name``; ``merge_and_unload()`` gives the same outputs. Heads
    (``modules_to_save``, e.g. a task SFT's classifier) come from the one adapter that saves them, unweighted;
    two adapters saving heads are refused (which head would be meant is ambiguous)."""
    if not adapter_dirs:
        raise ValueError("compose needs at least one adapter directory")
    from peft.utils import ModulesToSaveWrapper

    from .core.config import read_adapter_config

    with_heads = [d for d in adapter_dirs if read_adapter_config(d).get("modules_to_save")]
    if len(with_heads) > 1:
        raise ValueError(f"compose: {[str(d) for d in with_heads]} all save heads (modules_to_save); compose at most one adapter with heads")
    weights = [1.0] * len(adapter_dirs) if weights is None else list(weights)
    if len(weights) != len(adapter_dirs):
        raise ValueError(f"compose: {len(weights)} weights for {len(adapter_dirs)} adapters")
    model, parts, heads_of = base_model, [], None
    for i, directory in enumerate(adapter_dirs):
        name = f"{adapter_name}_{i}"
        model = load_sparse_adapter(model, directory, adapter_name=name)
        parts.append(name)
        if with_heads and directory == with_heads[0]:
            heads_of = name
    heads = None
    if heads_of is not None:  # the deltas are weighted and summed; the heads are taken over as they are
        heads = model.peft_config[heads_of].modules_to_save
        model.peft_config[heads_of].modules_to_save = None
    model.add_weighted_adapter(parts, weights, adapter_name)
    if heads_of is not None:
        model.peft_config[adapter_name].modules_to_save = list(heads)
        for module in model.modules():
            if isinstance(module, ModulesToSaveWrapper) and heads_of in module.modules_to_save:
                module.update(adapter_name)  # (PEFT's own registration of a head copy for the adapter)
                module.modules_to_save[adapter_name].load_state_dict(module.modules_to_save[heads_of].state_dict())
    model.set_adapter(adapter_name)
    for name in parts:
        model.delete_adapter(name)
    return model
