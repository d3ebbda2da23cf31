"""Sparse-aware optimizers and the optimizer-state surgery that dynamic methods need."""

from .sm3 import SM3

__all__ = ["SM3"]
