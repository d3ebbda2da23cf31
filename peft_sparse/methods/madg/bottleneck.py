"""Bottleneck language/task adapters (Houlsby et al.; the Pfeiffer placement used by MAD-X and MAD-G), PEFT
type ``BOTTLENECK``.

Each transformer block gets one adapter after its feed-forward output (the module that narrows the FFN back to
the hidden size, found from the model: :func:`peft_sparse.core.blocks.find_ffn_outputs`)::

    y = f(x)                              # the frozen FFN output, (..., h)
    y ← y + U·relu(D·y + b_D) + b_U       # D: (m, h) down-projection, U: (h, m) up-projection

Several active adapters apply in order, each to the output of the previous one: ``set_adapter(["lang", "task"])``
is MAD-X's ``Stack`` (language adapter first, task adapter on top). The map is non-linear, so an adapter cannot
be merged into the weights: inference runs unmerged, ``unload()`` removes the adapters, ``disable_adapter()``
turns them off. With ``init_weights=True`` (default) U = 0, so a new adapter is the identity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from peft.config import PeftConfig
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from torch import nn

from ...core.blocks import find_ffn_outputs, in_out_features
from ...core.config import PortableBaseModel
from ...registry import extend_peft_type

BOTTLENECK = extend_peft_type("BOTTLENECK")


def bottleneck(y: torch.Tensor, down: torch.Tensor, up: torch.Tensor, down_bias=None, up_bias=None) -> torch.Tensor:
    """y + U·relu(D·y + b_D) + b_U, computed in the adapter's dtype and returned in ``y``'s."""
    z = y.to(down.dtype)
    z = z + nn.functional.linear(torch.relu(nn.functional.linear(z, down, down_bias)), up, up_bias)  # (..., m) → (..., h)
    return z.to(y.dtype)


@dataclass
class BottleneckConfig(PortableBaseModel, PeftConfig):
    """A bottleneck adapter after every block's feed-forward output (module docstring)."""

    bottleneck_size: int = field(
        default=64,
        metadata={"help": "m, the adapter's inner size (MAD-X language adapters: 384 on a 768-wide model; task adapters: 48)."},
    )
    target_modules: Optional[Union[list[str], str]] = field(
        default=None,
        metadata={
            "help": (
                "The modules after which an adapter sits. None finds every block's feed-forward output from the model "
                "(Llama mlp.down_proj, GPT-2 mlp.c_proj, BERT/XLM-R output.dense); a list or regex names them, as in LoRA."
            )
        },
    )
    use_bias: bool = field(
        default=True, metadata={"help": "Biases b_D, b_U in the adapter (MAD-X: yes; MAD-G's generated adapters: no)."}
    )
    init_weights: bool = field(
        default=True, metadata={"help": "True: U = 0, a new adapter is the identity. False: U random too (for tests)."}
    )
    modules_to_save: Optional[list[str]] = field(
        default=None, metadata={"help": "Modules trained in full and saved with the adapter, e.g. a task head."}
    )

    def __post_init__(self):
        super().__post_init__()
        self.peft_type = BOTTLENECK
        if isinstance(self.bottleneck_size, bool) or not isinstance(self.bottleneck_size, int) or self.bottleneck_size <= 0:
            raise ValueError(f"bottleneck_size must be a positive integer, got bottleneck_size={self.bottleneck_size!r}")
        if isinstance(self.target_modules, (set, tuple)):
            self.target_modules = sorted(self.target_modules)


class BottleneckLayer(nn.Module, BaseTunerLayer):
    """A frozen module followed by the stack of its active bottleneck adapters."""

    adapter_layer_names = ("bottleneck_down", "bottleneck_up")
    other_param_names = ("bottleneck_size",)

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: BottleneckConfig):
        super().__init__()
        self.base_layer = base_layer
        shape = in_out_features(base_layer)
        if shape is None:
            raise TypeError(f"a bottleneck adapter follows an nn.Linear or Conv1D module, got {type(base_layer).__name__}")
        self.in_features, self.out_features = shape
        self.bottleneck_down = nn.ModuleDict()
        self.bottleneck_up = nn.ModuleDict()
        self.bottleneck_size: dict = {}
        self._active_adapter = adapter_name
        self.merged_adapters = []
        self.update_layer(adapter_name, config)

    def update_layer(self, adapter_name: str, config: BottleneckConfig) -> None:
        h, m = self.out_features, config.bottleneck_size
        weight = self.base_layer.weight
        dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        down = nn.Linear(h, m, bias=config.use_bias, device=weight.device, dtype=dtype)
        up = nn.Linear(m, h, bias=config.use_bias, device=weight.device, dtype=dtype)
        nn.init.kaiming_uniform_(down.weight, a=math.sqrt(5))
        if config.init_weights:
            nn.init.zeros_(up.weight)
        if config.use_bias:
            nn.init.zeros_(down.bias)
            nn.init.zeros_(up.bias)
        self.bottleneck_down[adapter_name], self.bottleneck_up[adapter_name] = down, up
        self.bottleneck_size[adapter_name] = m
        self.set_adapter(self.active_adapters)

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise ValueError(
            "a bottleneck adapter is non-linear and cannot be merged into the weights: run it unmerged, or unload() it"
        )

    def unmerge(self) -> None:
        pass  # never merged

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        y = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters:
            return y
        for name in self.active_adapters:  # MAD-X Stack: in order, each on the previous output
            if name in self.bottleneck_down:
                down, up = self.bottleneck_down[name], self.bottleneck_up[name]
                y = bottleneck(y, down.weight, up.weight, down.bias, up.bias)
        return y

    def __repr__(self) -> str:
        return "bottleneck." + super().__repr__()


def ffn_targets(model: nn.Module, config) -> PeftConfig:
    """Fill ``config.target_modules`` with the model's feed-forward outputs when it is None (exact names)."""
    if config.target_modules is None:
        names = find_ffn_outputs(model)
        config.target_modules = "^(" + "|".join(n.replace(".", r"\.") for n in names) + ")$"
    return config


class BottleneckModel(BaseTuner):
    """PEFT tuner of :class:`BottleneckConfig`: ``get_peft_model(model, BottleneckConfig(bottleneck_size=48))``."""

    prefix: str = "bottleneck_"
    tuner_layer_cls = BottleneckLayer
    target_module_mapping: dict = {}

    def _prepare_adapter_config(self, peft_config, model_config):
        return ffn_targets(self.model, peft_config)

    def _check_merge_allowed(self):
        raise ValueError(
            "bottleneck adapters are non-linear and cannot be merged into the weights: use unload() or run them unmerged"
        )

    def _create_and_replace(self, peft_config, adapter_name, target, target_name, parent, current_key, **kwargs):
        if isinstance(target, BottleneckLayer):
            target.update_layer(adapter_name, peft_config)
            return
        new_module = BottleneckLayer(target, adapter_name, peft_config)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)
