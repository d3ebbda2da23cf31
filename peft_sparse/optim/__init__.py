"""Sparse-aware optimizers and the optimizer-state surgery that dynamic methods need.

Importing this package registers :class:`~peft_sparse.optim.surgery.OptimizerStateKeeper` with the core: the
mask-editing API announces its edits, and the optimizer an edit names follows them.
"""

from . import surgery  # noqa: F401 (listens to the core's edits)
from .aged_adamw import AgedAdamW
from .sm3 import SM3

__all__ = ["AgedAdamW", "SM3"]
