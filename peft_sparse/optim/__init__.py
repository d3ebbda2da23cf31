"""Sparse-aware optimizers and the optimizer-state surgery that dynamic methods need."""

from .aged_adamw import AgedAdamW
from .sm3 import SM3

__all__ = ["AgedAdamW", "SM3"]
