"""Fields shared by every sparse method: targeting, budget, seed and the dtype of the values."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional, Union

import torch
from peft.config import PeftConfig

from .budget import BUDGET_SPLITS

VALUES_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}

# fields whose value a part of the package outside the core checks and normalises, registered by that part:
# ``slow_fast`` → a plain mapping of SlowFastConfig's fields (peft_sparse.schedules.slow_fast)
FIELD_CHECKS: dict[str, Callable] = {}


def dtype_name(dtype: Union[str, torch.dtype]) -> str:
    if isinstance(dtype, torch.dtype):
        for name, value in VALUES_DTYPES.items():
            if value == dtype:
                return name
        raise ValueError(f"values_dtype={dtype} is not supported; use one of {sorted(VALUES_DTYPES)}")
    name = str(dtype).removeprefix("torch.")
    if name not in VALUES_DTYPES:
        raise ValueError(f"values_dtype={dtype!r} is not supported; use one of {sorted(VALUES_DTYPES)}")
    return name


class PortableBaseModel:
    """A config mixin: an adapter of the built-in model records the model's name (``smollm2-135m-instruct``), not this
    machine's cache folder, and a loaded config names the folder where this machine holds it, so
    ``AutoPeftModelForCausalLM.from_pretrained(adapter_dir)`` finds the base model on any machine
    (:func:`peft_sparse.assets.portable_base_model`, :func:`~peft_sparse.assets.local_base_model`)."""

    def __post_init__(self):
        super().__post_init__()
        from ..assets import local_base_model

        self.base_model_name_or_path = local_base_model(self.base_model_name_or_path)

    def to_dict(self) -> dict:
        from ..assets import portable_base_model

        out = super().to_dict()
        out["base_model_name_or_path"] = portable_base_model(out.get("base_model_name_or_path"))
        return out


@dataclass
class SparseConfig(PortableBaseModel, PeftConfig):
    """Base configuration of a sparse delta :math:`\\theta' = \\theta + \\mathrm{scatter}(\\eta, \\phi)`.

    Exactly one of ``density`` and ``num_tunable_weights`` sets the budget. It is split over the
    targeted tensors in proportion to their size (the same density everywhere) and the exact
    per-module counts are recorded in ``tunable_weights_per_module`` when the adapter is created, so a
    saved config rebuilds tensors of identical shapes.
    """

    target_modules: Optional[Union[list[str], str]] = field(
        default=None,
        metadata={
            "help": (
                "Names of the modules to adapt, as in LoRA: a list matched exactly or as a suffix "
                "(e.g. ['q_proj', 'v_proj']), a regex string, or 'all-linear'. None uses PEFT's LoRA "
                "defaults for the architecture."
            )
        },
    )
    target_parameters: Optional[list[str]] = field(
        default=None,
        metadata={
            "help": (
                "Names of parameters to adapt directly, as in LoRA (PEFT's target_parameters): e.g. "
                "['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'] for the fused expert tensors of a mixture-of-"
                "experts model, matched exactly or as a suffix. A 3-D parameter (experts, rows, cols) gets one sparse "
                "delta per expert (each its own share of the budget); a 2-D one a single delta. With target_modules=None "
                "only these parameters are adapted."
            )
        },
    )
    exclude_modules: Optional[Union[list[str], str]] = field(
        default=None, metadata={"help": "Module names or a regex to leave out, as in LoRA."}
    )
    layers_to_transform: Optional[Union[list[int], int]] = field(
        default=None, metadata={"help": "Only adapt these layer indices, as in LoRA."}
    )
    layers_pattern: Optional[Union[list[str], str]] = field(
        default=None,
        metadata={"help": "Name of the layer list used with layers_to_transform (e.g. 'layers'), as in LoRA."},
    )
    modules_to_save: Optional[list[str]] = field(
        default=None,
        metadata={"help": "Modules trained densely and saved with the adapter (e.g. a new classifier head)."},
    )
    density: Optional[float] = field(
        default=None,
        metadata={"help": "Fraction of the targeted weights that are tunable, in (0, 1]. Exclusive with num_tunable_weights."},
    )
    num_tunable_weights: Optional[int] = field(
        default=None,
        metadata={"help": "Exact total number of tunable weights over all targeted modules. Exclusive with density."},
    )
    init: Union[str, Callable] = field(
        default="random",
        metadata={
            "help": (
                "How the initial indices are chosen. 'external' marks indices that only a saved adapter file "
                "provides (a callable importance function, a composition, a lottery-ticket selection); such a "
                "config needs its adapter weights loaded before use. Other choices depend on the method."
            )
        },
    )
    budget_split: str = field(
        default="uniform",
        metadata={
            "help": (
                "How the budget is shared among the targeted tensors: 'uniform' (the same density in each, as in the "
                "thesis) or 'lora' (in proportion to out + in, as LoRA's rank shares its parameters: small matrices "
                "get a higher density), or 'adaptive' (SpIEL-AG only: uniform at first, then each reselection drops the "
                "globally smallest |φ| and grows the candidates with the largest |ĝ|/√ŝ over all tensors, so tensors "
                "gain or lose weights; tunable_weights_per_module follows)."
            )
        },
    )
    seed: int = field(
        default=0,
        metadata={
            "help": (
                "Seed of the initial index selection η: with the module's name it decides each module's indices, "
                "independently of module order, of torch's global generator and of the process, so every rank of a "
                "distributed run selects the same indices. It does not decide values (see init_weights)."
            )
        },
    )
    init_weights: bool = field(
        default=True,
        metadata={
            "help": (
                "True: the values φ start at 0 (the adapter is the identity, as in training). False: they start at "
                "random N(0, 0.02²) values drawn from torch's global generator (torch.manual_seed decides them, as for "
                "LoRA's init_lora_weights=False), so two adapters made from one config share their indices (seed) but "
                "not their values, and merge and save/load tests test something; never for training."
            )
        },
    )
    index_storage: str = field(
        default="auto",
        metadata={
            "help": (
                "How the saved file stores each tensor's positions: 'list' (sorted int32 indices, 4 bytes per active "
                "weight), 'bitmap' (⌈N/8⌉ bytes per N-weight tensor), 'elias-fano' (the Elias–Fano code of the sorted "
                "indices, about 2 + log2(N/n) bits per index: within 1.2× of the information in the choice up to "
                "density 20%) or 'auto' (default): whichever is smallest for each tensor — Elias–Fano below density "
                "1/4, the bitmap above. Loading reads every form; the model in memory is the same."
            )
        },
    )
    base_vocab_size: Optional[int] = field(
        default=None,
        metadata={
            "help": (
                "Set when the adapter is created: the rows of the model's input embedding. save_pretrained saves the "
                "embedding layers with the adapter only when that count has changed (a resized vocabulary)."
            )
        },
    )
    untie_output_embeddings: bool = field(
        default=True,
        metadata={
            "help": (
                "When a targeted input embedding (nn.Embedding) shares its weight with an output layer (tied word "
                "embeddings), give the output layer its own frozen copy first, so the delta changes the input lookup "
                "only, before and after merging (thesis §4.4.2: otherwise most of the budget lands in the output "
                "embedding). False refuses such a target. The model's config then says tie_word_embeddings=False."
            )
        },
    )
    training_merge: bool = field(
        default=False,
        metadata={
            "help": (
                "Opt-in speed-up for GPU training: while one adapter trains on a plain nn.Linear, keep θ + δ in the base "
                "weight's own storage between optimizer steps, written once per step. By default a layer writes θ + δ there "
                "only for the length of its own forward and backward products and writes θ back right after, so nothing "
                "else ever sees it (PEFT's invariant: base weights never change); with this option the base weight reads "
                "θ + δ through named_parameters() during training (state_dict(), eval(), merging and saving still see θ)."
            )
        },
    )
    slow_fast: Optional[dict] = field(
        default=None,
        metadata={
            "help": (
                "Slow-fast learning rates (peft_sparse.SlowFastConfig or its fields as a mapping), recorded with the adapter; "
                "the Trainer callback (added by recipes, or SlowFastCallback()) applies them."
            )
        },
    )
    values_dtype: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "dtype of the trainable values φ: float32, bfloat16, float16 or float64. None: float32, or the base "
                "weights' floating dtype when the adapter is created with get_peft_model(..., autocast_adapter_dtype=False) "
                "(PEFT's meaning of that switch). The dtype chosen is recorded in the saved config."
            )
        },
    )
    tunable_weights_per_module: Optional[dict[str, int]] = field(
        default=None,
        metadata={
            "help": (
                "Exact number of tunable weights per adapted module, filled in when the adapter is created and "
                "saved with it so that a reload rebuilds identical shapes. Leave unset when creating an adapter."
            )
        },
    )

    #: string choices of ``init`` besides "external"; whether a callable importance function is accepted
    init_choices: ClassVar[tuple[str, ...]] = ("random",)
    init_accepts_callable: ClassVar[bool] = False
    moves_budget: ClassVar[bool] = False  # whether budget_split='adaptive' has a policy that moves budget

    block_shape: tuple[int, int] = field(
        default=(1, 1),
        metadata={
            "help": (
                "Granularity of the selection: (1, 1) selects single weights (unstructured); e.g. (16, 16), (32, 32) "
                "or (1, 64) select, drop and grow whole blocks, which must tile every targeted matrix. Budgets are "
                "rounded to whole blocks. On GPU the value gradient of block adapters is a block-sparse product."
            )
        },
    )
    module_shapes: Optional[dict[str, list[int]]] = field(
        default=None,
        metadata={
            "help": (
                "Logical (out_features, in_features) of every adapted module, recorded with the counts so that an "
                "adapter file is checked against the model it is loaded into. Leave unset when creating an adapter."
            )
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.values_dtype is not None:
            self.values_dtype = dtype_name(self.values_dtype)
        if callable(self.init):
            if not self.init_accepts_callable:
                raise ValueError(f"{type(self).__name__} does not accept a callable init, got init={self.init!r}")
        elif self.init not in (*self.init_choices, "external"):
            raise ValueError(f"init must be one of {[*self.init_choices, 'external']}, got init={self.init!r}")
        if isinstance(self.target_modules, list):
            self.target_modules = set(self.target_modules)
        if self.target_parameters is not None:
            if isinstance(self.target_parameters, str) or not all(isinstance(n, str) and n for n in self.target_parameters):
                raise ValueError(
                    f"target_parameters must be a list of parameter names, got target_parameters={self.target_parameters!r}"
                )
            self.target_parameters = sorted(set(self.target_parameters))
        if isinstance(self.exclude_modules, list):
            self.exclude_modules = set(self.exclude_modules)
        if (self.density is None) == (self.num_tunable_weights is None):
            raise ValueError(
                "give exactly one of density and num_tunable_weights, got "
                f"density={self.density!r} and num_tunable_weights={self.num_tunable_weights!r}"
            )
        if self.density is not None:
            if isinstance(self.density, bool) or not isinstance(self.density, (int, float)):
                raise ValueError(f"density must be a number in (0, 1], got density={self.density!r}")
            if not 0.0 < float(self.density) <= 1.0:
                raise ValueError(f"density must be in (0, 1], got density={self.density!r}")
            self.density = float(self.density)
        if self.num_tunable_weights is not None:
            if isinstance(self.num_tunable_weights, bool) or not isinstance(self.num_tunable_weights, int):
                raise ValueError(
                    f"num_tunable_weights must be a positive integer, got num_tunable_weights={self.num_tunable_weights!r}"
                )
            if self.num_tunable_weights <= 0:
                raise ValueError(
                    f"num_tunable_weights must be a positive integer, got num_tunable_weights={self.num_tunable_weights!r}"
                )
        if self.layers_pattern and self.layers_to_transform is None:
            raise ValueError(
                f"layers_pattern={self.layers_pattern!r} is only used together with layers_to_transform, which is None"
            )
        if self.tunable_weights_per_module is not None:
            for name, count in self.tunable_weights_per_module.items():
                if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                    raise ValueError(
                        f"tunable_weights_per_module[{name!r}]={count!r} must be a non-negative integer"
                    )
        shape = self.block_shape
        if (
            not isinstance(shape, (tuple, list))
            or len(shape) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in shape)
        ):
            raise ValueError(f"block_shape must be two positive integers (rows, cols), got block_shape={shape!r}")
        self.block_shape = tuple(shape)
        if self.budget_split not in BUDGET_SPLITS:
            raise ValueError(f"budget_split must be one of {list(BUDGET_SPLITS)}, got budget_split={self.budget_split!r}")
        if self.budget_split == "adaptive" and not self.moves_budget:
            raise ValueError(
                f"budget_split='adaptive' needs a method whose reselections move budget between tensors (SpIELConfig with "
                f"growth='ag'); {type(self).__name__} keeps its indices: use 'uniform' or 'lora'"
            )
        if self.index_storage not in ("auto", "list", "bitmap", "elias-fano"):
            raise ValueError(
                f"index_storage must be 'auto', 'list', 'bitmap' or 'elias-fano', got index_storage={self.index_storage!r}"
            )
        if not isinstance(self.untie_output_embeddings, bool):
            raise ValueError(f"untie_output_embeddings must be True or False, got untie_output_embeddings={self.untie_output_embeddings!r}")
        if not isinstance(self.training_merge, bool):
            raise ValueError(f"training_merge must be True or False, got training_merge={self.training_merge!r}")
        if self.slow_fast is not None:
            self.slow_fast = FIELD_CHECKS["slow_fast"](self.slow_fast)  # (stored as a plain mapping: JSON)
        if not isinstance(self.init_weights, bool):
            raise ValueError(f"init_weights must be True or False, got init_weights={self.init_weights!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got seed={self.seed!r}")

    def to_dict(self) -> dict:
        out = super().to_dict()
        if callable(self.init):  # a function is not serialized: the saved indices stand for it
            out["init"] = "external"
        return out

    @property
    def torch_values_dtype(self) -> torch.dtype:
        return VALUES_DTYPES[self.values_dtype or "float32"]

    def sparse_fields(self) -> dict:
        """The fields every sparse config shares, e.g. to re-express an adapter as another sparse type."""
        names = [
            "target_modules", "target_parameters", "exclude_modules", "layers_to_transform", "layers_pattern", "modules_to_save",
            "seed", "init_weights", "budget_split", "values_dtype", "index_storage", "slow_fast", "tunable_weights_per_module", "module_shapes", "block_shape", "base_model_name_or_path", "revision",
            "task_type", "inference_mode",
        ]  # fmt: skip
        out = {n: getattr(self, n) for n in names}
        out["num_tunable_weights"] = sum(self.tunable_weights_per_module.values()) if self.tunable_weights_per_module else self.num_tunable_weights
        out["density"] = None if out["num_tunable_weights"] is not None else self.density
        return out


def read_adapter_config(adapter_dir: Union[str, os.PathLike]) -> dict:
    """The raw ``adapter_config.json`` of a saved adapter, with a clear error when it is missing."""
    path = os.path.join(adapter_dir, "adapter_config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{adapter_dir!s} holds no adapter_config.json; is it an adapter directory?")
    with open(path, encoding="utf-8") as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is damaged or incomplete: it is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object of config fields, found a {type(raw).__name__}")
    return raw
    with open(path) as f:
        return json.load(f)


def removed_fields(**removed: tuple):
    """Class decorator for a config that lost fields: saved adapter configs that still hold them keep loading.

    PEFT hands every key of a saved ``adapter_config.json`` to the constructor (and drops a key the class does not
    know with a warning about library versions). A removed key is taken here instead: accepted when its value is one
    the removed field selected its remaining behaviour with (its old default), refused by name otherwise, since the
    behaviour it asked for is gone. ``removed``: name → (the accepted values, or a function of the constructed config
    returning them — for a default that depended on other fields; what to do instead)."""

    def decorate(cls):
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            given = {name: kwargs.pop(name) for name in list(kwargs) if name in removed}
            init(self, *args, **kwargs)
            for name, value in given.items():
                accepted, instead = removed[name]
                accepted = accepted(self) if callable(accepted) else accepted
                if not any(type(value) is type(a) and value == a for a in accepted):
                    raise ValueError(
                        f"{cls.__name__} has no field {name} any more, and {name}={value!r} asks for a behaviour it no "
                        f"longer offers: {instead}. A saved config holding {name} loads when it is "
                        f"{' or '.join(repr(a) for a in accepted)}, the behaviour that remains"
                    )

        cls.__init__ = __init__
        cls.removed_fields = tuple(removed)
        return cls

    return decorate
