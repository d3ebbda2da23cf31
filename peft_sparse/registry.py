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

Tested with PEFT 0.21.x on CPython 3.11 (CI) and 3.12 (GPU machine); the supported PEFT range is
pinned in ``pyproject.toml``.
"""

from __future__ import annotations

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


def register(name: str, config_cls, model_cls) -> None:
    """Register a sparse method with PEFT under PEFT type ``name.upper()`` (idempotent)."""
    peft_type = extend_peft_type(name.upper())
    if PEFT_TYPE_TO_CONFIG_MAPPING.get(peft_type) is config_cls:
        return
    register_peft_method(name=name.lower(), config_cls=config_cls, model_cls=model_cls, prefix=model_cls.prefix)


_check_peft_version()
