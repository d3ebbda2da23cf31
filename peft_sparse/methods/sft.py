"""Fixed-mask sparse fine-tuning (SFT): the indices η are chosen once, when the adapter is created.

θ' = θ + scatter(η, φ) with η picked at random, by weight magnitude, or by a user importance
function, and only φ trained. This is the simplest policy on the shared sparse core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar, Union

import torch
from peft.utils import PeftType

from ..core.config import SparseConfig
from ..core.layer import SparseLayer
from ..core.selection import module_generator, random_indices, top_indices
from ..core.tuner import SparseTuner


@dataclass
class SparseFTConfig(SparseConfig):
    """Configuration of fixed-mask sparse fine-tuning, PEFT type ``"SFT"``.

    ``init`` is ``"random"`` (uniform, seeded per module), ``"magnitude"`` (largest |θ|, ties to the
    lowest index) or a callable ``importance(module_name, weight) -> scores`` receiving the logical
    (out, in) weight and returning scores of the same shape; the top-scoring positions are tuned.
    A callable is **not serialized**: the saved config says ``init="external"`` and the saved
    indices stand for it.
    """

    init: Union[str, Callable] = field(
        default="random",
        metadata={
            "help": (
                "'random', 'magnitude', or a callable importance(module_name, weight) -> scores (not serialized; "
                "saved as 'external', the adapter file keeps the chosen indices)."
            )
        },
    )
    init_choices: ClassVar[tuple[str, ...]] = ("random", "magnitude")
    init_accepts_callable: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        self.peft_type = PeftType.SFT


class SparseFTModel(SparseTuner):
    """PEFT tuner of :class:`SparseFTConfig`."""

    prefix: str = "sparse_"

    def initial_indices(self, config: SparseFTConfig, layer: SparseLayer, module_name: str, count: int) -> torch.Tensor:
        grid = self.grid(config, layer)
        if config.init == "random":
            return grid.expand(random_indices(grid.numel, count // grid.unit, module_generator(config.seed, module_name)))
        weight = layer.logical_weight().detach()
        if config.init == "magnitude":
            scores = weight.abs()
        else:
            scores = config.init(module_name, weight)
            if not isinstance(scores, torch.Tensor) or scores.shape != weight.shape:
                raise ValueError(
                    f"init importance function returned {getattr(scores, 'shape', type(scores))} for {module_name}; "
                    f"expected a tensor of shape {tuple(weight.shape)}"
                )
        return grid.expand(top_indices(grid.reduce(scores.float().cpu()), count // grid.unit))
