"""peft_sparse: sparse, composable fine-tuning as first-class PEFT methods.

Importing this package registers every method with PEFT, so ``get_peft_model``,
``PeftModel.from_pretrained`` and ``PeftConfig.from_pretrained`` work for them as for LoRA.
"""

from . import registry
from .accel import fast_paths, gpu  # noqa: F401  (gpu: hands the core its Triton kernels)
from .conversion import convert_to_lora, save_as_lora
from .core.compose import convert_config, load_sparse_adapter, merge_sparse_adapters
from .core.config import SparseConfig
from .core.layer import SparseLayer
from .core.merging import merged_for_inference
from .methods.madg import BottleneckConfig, BottleneckModel, MADGConfig, MADGModel, generate_language_adapter
from .methods.lt_sft import LTSFTConfig, LTSFTModel, LTSFTScheduler
from .methods.s4 import S4Config, S4Model, S4Router, build_s4_model, detect_language_masks
from .methods.sft import SparseFTConfig, SparseFTModel
from .methods.spiel import SpIELConfig, SpIELModel, SpIELScheduler
from .optim import SM3, AgedAdamW
from .schedules.slow_fast import SlowFastConfig, SlowFastScheduler
from .schedules.weight_decay import auto_weight_decay

registry.register("sft", SparseFTConfig, SparseFTModel)
registry.register("spiel", SpIELConfig, SpIELModel)
registry.register("lt_sft", LTSFTConfig, LTSFTModel)
registry.register("s4", S4Config, S4Model)
registry.register("bottleneck", BottleneckConfig, BottleneckModel)
registry.register("madg", MADGConfig, MADGModel)

from .callbacks import LTSFTCallback, S4Callback, SlowFastCallback, SpIELCallback  # noqa: E402  (needs transformers, imported after registration)

__version__ = "0.1.0"

__all__ = [
    "AgedAdamW",
    "BottleneckConfig",
    "BottleneckModel",
    "MADGConfig",
    "MADGModel",
    "generate_language_adapter",
    "LTSFTCallback",
    "LTSFTConfig",
    "LTSFTModel",
    "LTSFTScheduler",
    "SparseConfig",
    "SparseFTConfig",
    "SparseFTModel",
    "SparseLayer",
    "S4Callback",
    "S4Config",
    "S4Model",
    "S4Router",
    "SM3",
    "auto_weight_decay",
    "SlowFastCallback",
    "SlowFastConfig",
    "SlowFastScheduler",
    "SpIELCallback",
    "SpIELConfig",
    "SpIELModel",
    "SpIELScheduler",
    "build_s4_model",
    "convert_config",
    "convert_to_lora",
    "detect_language_masks",
    "fast_paths",
    "load_sparse_adapter",
    "merge_sparse_adapters",
    "merged_for_inference",
    "save_as_lora",
]
