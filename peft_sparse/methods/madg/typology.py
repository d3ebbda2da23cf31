"""URIEL typology vectors t⁽ˡ⁾ for MAD-G (thesis §3.3.1): 289 features from ``lang2vec``, the k-NN-imputed
syntax (103), phonology (28) and inventory (158) sets, concatenated in that order. Languages are named by
ISO 639-3 codes; a user may pass their own 289-dimensional vector for any name instead.

``lang2vec`` ships its data with the wheel and works offline. It imports ``pkg_resources``, which recent
setuptools no longer provides; when it is missing, a one-function stand-in (``resource_filename``, the only
name lang2vec uses) is installed just for that import.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import os
import re
import sys
import types
from typing import Mapping, Optional, Sequence

import torch

FEATURE_SETS = ("syntax_knn", "phonology_knn", "inventory_knn")
TYPOLOGY_DIM = 289
ISO_639_3 = re.compile(r"^[a-z]{3}$")


def _resource_filename(package: str, name: str) -> str:
    spec = importlib.util.find_spec(package)
    return os.path.join(os.path.dirname(spec.origin), name)


def _import_unshadowed(name: str):
    """Import ``name`` from the installed ``lang2vec`` package even where a plain ``lang2vec.py`` would be found first:
    lang2vec's install also puts a script of that name in the environment's bin/, which is sys.path[0] when a console
    command (``peft-sparse``) runs. Folders whose ``lang2vec`` is such a plain module are left out for this import."""
    package = name.partition(".")[0]
    module = sys.modules.get(package)
    if module is not None and not hasattr(module, "__path__"):  # a plain module took the package's name
        del sys.modules[package]

    def shadows(entry: str) -> bool:
        folder = entry or os.getcwd()
        return os.path.isfile(os.path.join(folder, package + ".py")) and not os.path.isdir(os.path.join(folder, package))

    saved = list(sys.path)
    sys.path[:] = [entry for entry in saved if not shadows(entry)]
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved


@functools.lru_cache(maxsize=1)
def _lang2vec():
    try:
        import pkg_resources  # noqa: F401
    except ImportError:
        sys.modules["pkg_resources"] = types.SimpleNamespace(resource_filename=_resource_filename)
    try:
        l2v = _import_unshadowed("lang2vec.lang2vec")
    except ImportError as exc:
        raise ImportError(
            "URIEL typology vectors need lang2vec: pip install 'peft-sparse[madg]' (or pass typology vectors yourself)"
        ) from exc
    return l2v


@functools.lru_cache(maxsize=1)
def feature_names() -> tuple:
    """The names of the 289 features, in vector order (``S_SVO``, …, ``P_…``, ``INV_…``)."""
    l2v = _lang2vec()
    header = l2v.get_features(["eng"], "+".join(FEATURE_SETS), header=True)["CODE"]
    return tuple(str(x) for x in header)


@functools.lru_cache(maxsize=1)
def known_languages() -> frozenset:
    return frozenset(str(x) for x in _lang2vec().LANGUAGES)


def uriel_vector(code: str) -> torch.Tensor:
    """t⁽ˡ⁾ of ISO 639-3 ``code``: a (289,) float32 tensor. An unknown code is refused with close known codes."""
    if not isinstance(code, str) or not ISO_639_3.match(code):
        raise ValueError(f"language {code!r} is not an ISO 639-3 code (three lowercase letters, e.g. 'deu', 'swh')")
    if code not in known_languages():
        known = sorted(known_languages())
        close = [c for c in known if c[:2] == code[:2]] + difflib.get_close_matches(code, known, n=6, cutoff=0.6)
        close = list(dict.fromkeys(close))[:6]
        hint = f"; close codes in URIEL: {close}" if close else ""
        raise ValueError(f"language {code!r} is not in the URIEL database{hint}; or pass its vector in typology_vectors")
    values = _lang2vec().get_features([code], "+".join(FEATURE_SETS))[code]
    vector = torch.tensor([float(v) for v in values], dtype=torch.float32)
    if vector.numel() != TYPOLOGY_DIM:  # pragma: no cover  (a lang2vec release with other feature sets)
        raise RuntimeError(f"lang2vec returned {vector.numel()} features for {code!r}, expected {TYPOLOGY_DIM}")
    return vector


def check_vector(name: str, vector) -> torch.Tensor:
    t = torch.as_tensor(vector, dtype=torch.float32).flatten()
    if t.numel() != TYPOLOGY_DIM:
        raise ValueError(
            f"typology vector of {name!r} has {t.numel()} entries; MAD-G needs {TYPOLOGY_DIM} (URIEL {'+'.join(FEATURE_SETS)})"
        )
    if not torch.isfinite(t).all():
        raise ValueError(f"typology vector of {name!r} has non-finite entries")
    return t


def typology_vector(name: str, vectors: Optional[Mapping[str, Sequence[float]]] = None) -> torch.Tensor:
    """The user's vector for ``name`` if given, else URIEL's."""
    if vectors and name in vectors:
        return check_vector(name, vectors[name])
    return uriel_vector(name)
