"""The only module that touches PEFT internals: the ``PeftType`` extension and every private PEFT name
the package uses, re-exported from here.

PEFT's :func:`peft.utils.register_peft_method` accepts only names that already exist in the
``PeftType`` enum, and a Python ``Enum`` cannot be extended through its public API. We add our
members to ``PeftType`` in place (same mechanism ``EnumType`` uses when it builds a class), then
register each method through PEFT's own registration function. No PEFT file is edited.

Private names used elsewhere, all imported here: ``BufferDict`` (``peft.tuners._buffer_dict``: the
indices and ages as persistent buffers, as PEFT's own tuners keep theirs), ``_maybe_include_all_linear_layers``
and ``_ExcludedModule`` (``peft.tuners.tuners_utils``: ``target_modules="all-linear"`` and
``exclude_modules`` resolved exactly as LoRA resolves them) and ``PEFT_TYPE_TO_CONFIG_MAPPING``
(``peft.mapping``).

Two PEFT functions are wrapped where ``PeftModel`` calls them, for our types only. ``load_peft_weights`` names a
damaged ``adapter_model.safetensors`` (:func:`name_damaged_weight_files`). ``get_peft_model_state_dict`` resolves
``save_embedding_layers="auto"`` by itself (:func:`resolve_embedding_saving`). PEFT's rule would save the whole
base embedding table whenever an embedding is targeted (a sparse adapter already holds its delta) and otherwise
reload the base model's config, from the hub if need be, to tell whether the vocabulary was resized; we compare
the input embedding's rows with the count the adapter config recorded when it was created, offline.

``PeftModel.save_pretrained`` is wrapped too, for models holding our types only: it takes three more keyword
arguments, ``values_dtype``, ``allow_lossy_cast`` and ``save_ages`` (:mod:`peft_sparse.core.storage` says what they
do), which PEFT would otherwise accept and ignore. They reach the tuner's ``_get_adapter_state_dict`` for the
duration of the call, and a saved config records the ``values_dtype`` its file holds.

Tested with PEFT 0.21.x on CPython 3.11 (CI) and 3.12 (GPU machine); the supported PEFT range is
pinned in ``pyproject.toml``.
"""

from __future__ import annotations

import functools
import warnings

import peft
from packaging.version import Version
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.tuners_utils import _ExcludedModule as ExcludedModule
from peft.tuners.tuners_utils import _maybe_include_all_linear_layers as include_all_linear_layers
from peft.utils import PeftType, register_peft_method

__all__ = ["PEFT_TYPE_TO_CONFIG_MAPPING", "BufferDict", "ExcludedModule", "include_all_linear_layers", "extend_peft_type", "register"]

SUPPORTED_PEFT = (Version("0.21.0"), Version("0.22.0"))


def _check_peft_version() -> None:
    version = Version(peft.__version__)
    if not (SUPPORTED_PEFT[0] <= version < SUPPORTED_PEFT[1]):
        raise ImportError(
            f"peft_sparse supports peft>={SUPPORTED_PEFT[0]},<{SUPPORTED_PEFT[1]}; found peft=={peft.__version__}. "
            "Install a supported PEFT release."
        )


def extend_peft_type(name: str) -> PeftType:
    """Add ``name`` as a member of :class:`peft.utils.PeftType` (idempotent) and return it."""
    if name in PeftType.__members__:
        return PeftType[name]
    member = str.__new__(PeftType, name)
    member._name_ = name
    member._value_ = name
    member.__objclass__ = PeftType
    member._sort_order_ = len(PeftType._member_names_)
    PeftType._member_names_.append(name)
    PeftType._member_map_[name] = member
    PeftType._value2member_map_[name] = member
    type.__setattr__(PeftType, name, member)
    return member


OUR_TYPES: set[str] = set()


def register(name: str, config_cls, model_cls) -> None:
    """Register a sparse method with PEFT under PEFT type ``name.upper()`` (idempotent)."""
    peft_type = extend_peft_type(name.upper())
    OUR_TYPES.add(peft_type.value)
    resolve_embedding_saving()
    name_damaged_weight_files()
    wrap_save_pretrained()
    if PEFT_TYPE_TO_CONFIG_MAPPING.get(peft_type) is config_cls:
        return
    register_peft_method(name=name.lower(), config_cls=config_cls, model_cls=model_cls, prefix=model_cls.prefix)


def _holds_our_types(model) -> bool:
    configs = getattr(model, "peft_config", None)
    return isinstance(configs, dict) and any(getattr(c.peft_type, "value", c.peft_type) in OUR_TYPES for c in configs.values())


def wrap_save_pretrained() -> None:
    """``PeftModel.save_pretrained(..., values_dtype=None, allow_lossy_cast=False, save_ages=False)`` for sparse
    adapters (idempotent; module docstring)."""
    from peft import PeftModel

    original = PeftModel.save_pretrained
    if getattr(original, "peft_sparse_wrapped", False):
        return

    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, **kwargs):
        if not _holds_our_types(self):
            return original(self, save_directory, *args, **kwargs)
        from .core.config import dtype_name
        from .core.storage import save_options

        values_dtype = kwargs.pop("values_dtype", None)
        allow_lossy_cast = kwargs.pop("allow_lossy_cast", False)
        save_ages = kwargs.pop("save_ages", False)
        for name, value in (("allow_lossy_cast", allow_lossy_cast), ("save_ages", save_ages)):
            if not isinstance(value, bool):
                raise ValueError(f"save_pretrained: {name} must be True or False, got {name}={value!r}")
        if values_dtype is not None:
            try:
                values_dtype = dtype_name(values_dtype)
            except ValueError:
                raise ValueError(
                    f"save_pretrained: values_dtype={values_dtype!r} is not supported; use one of float32, bfloat16, "
                    "float16, float64"
                ) from None
        from .core.config import SparseConfig

        ours = {n: c for n, c in self.peft_config.items() if isinstance(c, SparseConfig)}  # (sparse deltas: MAD-G and bottleneck adapters have no values)
        if not ours and (values_dtype is not None or allow_lossy_cast or save_ages):
            raise ValueError("save_pretrained: values_dtype, allow_lossy_cast and save_ages apply to sparse adapters, and "
                             f"this model holds none (its adapters: {sorted(self.peft_config)})")  # fmt: skip
        recorded = {n: c.values_dtype for n, c in ours.items()}
        from .core.config import VALUES_DTYPES

        try:
            if values_dtype is not None:
                for config in ours.values():
                    config.values_dtype = values_dtype  # (the saved config names the dtype its file holds)
            with save_options(
                values_dtype=None if values_dtype is None else VALUES_DTYPES[values_dtype],
                allow_lossy_cast=allow_lossy_cast,
                save_ages=save_ages,
            ):
                return original(self, save_directory, *args, **kwargs)
        finally:
            for name, config in ours.items():
                config.values_dtype = recorded[name]

    save_pretrained.peft_sparse_wrapped = True
    PeftModel.save_pretrained = save_pretrained


def resolve_embedding_saving() -> None:
    """Wrap ``get_peft_model_state_dict`` where ``PeftModel.save_pretrained`` calls it (idempotent; module docstring)."""
    import peft.peft_model as peft_model

    original = peft_model.get_peft_model_state_dict
    if getattr(original, "peft_sparse_wrapped", False):
        return

    def get_peft_model_state_dict(model, *args, **kwargs):
        adapter_name = kwargs.get("adapter_name", args[1] if len(args) > 1 else "default")
        config = model.peft_config.get(adapter_name) if hasattr(model, "peft_config") else None
        recorded = getattr(config, "base_vocab_size", None)
        if len(args) < 4 and kwargs.get("save_embedding_layers", "auto") == "auto" and config is not None and getattr(config.peft_type, "value", config.peft_type) in OUR_TYPES and recorded is not None:
            embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
            embeddings = embeddings.get_base_layer() if hasattr(embeddings, "get_base_layer") else embeddings
            resized = embeddings is not None and getattr(embeddings, "num_embeddings", recorded) != recorded
            if resized:
                warnings.warn(
                    f"the input embedding has {embeddings.num_embeddings} rows but had {recorded} when adapter "
                    f"{adapter_name!r} was created: saving the resized embedding layers with the adapter"
                )
            kwargs["save_embedding_layers"] = resized
        return original(model, *args, **kwargs)

    get_peft_model_state_dict.peft_sparse_wrapped = True
    get_peft_model_state_dict.__wrapped__ = original
    peft_model.get_peft_model_state_dict = get_peft_model_state_dict


def name_damaged_weight_files() -> None:
    """Wrap ``load_peft_weights`` where ``PeftModel.load_adapter`` (and so ``from_pretrained``) calls it (idempotent):
    for a local adapter of our types, a damaged ``adapter_model.safetensors`` is refused with the file named
    (:func:`peft_sparse.core.storage.reading`) instead of safetensors' bare header error."""
    import os

    import peft.peft_model as peft_model

    original = peft_model.load_peft_weights
    if getattr(original, "peft_sparse_wrapped", False):
        return

    def load_peft_weights(model_id, *args, **kwargs):
        folder = os.path.join(str(model_id), kwargs["subfolder"]) if kwargs.get("subfolder") else str(model_id)
        path = os.path.join(folder, "adapter_model.safetensors")
        if not (os.path.isfile(path) and _saved_peft_type(folder) in OUR_TYPES):
            return original(model_id, *args, **kwargs)
        from .core.storage import reading

        with reading(path):
            return original(model_id, *args, **kwargs)

    load_peft_weights.peft_sparse_wrapped = True
    load_peft_weights.__wrapped__ = original
    peft_model.load_peft_weights = load_peft_weights


def _saved_peft_type(folder: str):
    import json
    import os

    try:
        with open(os.path.join(folder, "adapter_config.json"), encoding="utf-8") as f:
            return json.load(f).get("peft_type")
    except (OSError, ValueError, AttributeError):
        return None


_check_peft_version()
