"""MAD-G (thesis ch. 3): bottleneck adapters (PEFT type ``BOTTLENECK``) and their typology-conditioned
generator (PEFT type ``MADG``)."""

from .bottleneck import BottleneckConfig, BottleneckLayer, BottleneckModel
from .generator import MADGConfig, MADGGenerator, MADGLayer, MADGModel, generate_language_adapter
from .typology import feature_names, typology_vector, uriel_vector

__all__ = [
    "BottleneckConfig", "BottleneckLayer", "BottleneckModel", "MADGConfig", "MADGGenerator", "MADGLayer", "MADGModel",
    "feature_names", "generate_language_adapter", "typology_vector", "uriel_vector",
]  # fmt: skip
