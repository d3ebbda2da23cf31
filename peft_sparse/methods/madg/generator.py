"""MAD-G: bottleneck language adapters generated from URIEL typology (thesis ch. 3, §3.3.1–3.3.2), PEFT type ``MADG``.

For a language l with typology vector t⁽ˡ⁾ (289 URIEL features, :mod:`.typology`)::

    λ⁽ˡ⁾ = V·t⁽ˡ⁾                         # V: (d_l, 289), the language embedding            (§3.3.1)
    θ⁽ˡ'ᵇ⁾ = W_b·λ⁽ˡ⁾                      # MAD-G: W = [W_1 … W_{n_b}], each (2hm, d_l)       (Eq. 3.1)
    θ⁽ˡ'ᵇ⁾ = W·(λ⁽ˡ⁾ ⊕ λ⁽ᵇ⁾)               # MAD-G-LS: W (2hm, d_l + d_b), λ⁽ᵇ⁾ a learned layer embedding (Eq. 3.2)

θ⁽ˡ'ᵇ⁾ holds block b's adapter: the first h·m entries are the down-projection D (m, h), row-major, the next
h·m the up-projection U (h, m); the adapter is y + U·relu(D·y) after the block's feed-forward output, as
:mod:`.bottleneck` (no biases: 2hm parameters per adapter, as in the thesis). Only V, W and the layer
embeddings train; the base model is frozen. Each block generates its own adapter inside its forward pass,
from the current language, so no more than one block's adapter exists outside autograd's saved tensors.

The language of a batch: ``model(**batch, language=[...])`` (one language per batch; a mixed batch is refused),
or ``model.base_model.set_language("deu")`` before generation. Any language with a typology vector works,
including languages unseen in training — the point of MAD-G: :func:`generate_language_adapter` writes a
standalone ``BOTTLENECK`` adapter for it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from peft.config import PeftConfig
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from safetensors.torch import save_file
from torch import nn

from ...core.blocks import in_out_features
from ...core.config import PortableBaseModel
from ...data.sampling import check_single_language
from ...registry import extend_peft_type
from .bottleneck import BottleneckConfig, bottleneck, ffn_targets
from .typology import TYPOLOGY_DIM, check_vector, typology_vector

MADG = extend_peft_type("MADG")


@dataclass
class MADGConfig(PortableBaseModel, PeftConfig):
    """A typology-conditioned generator of bottleneck language adapters (module docstring)."""

    languages: list = field(
        default_factory=list,
        metadata={
            "help": "The training languages: ISO 639-3 codes (URIEL vectors from lang2vec) or names given in typology_vectors."
        },
    )
    typology_vectors: Optional[dict] = field(
        default=None,
        metadata={
            "help": f"Your own typology vectors, {{name: [{TYPOLOGY_DIM} floats]}}; they take precedence over URIEL's and are saved with the config."
        },
    )
    bottleneck_size: int = field(default=384, metadata={"help": "m, the generated adapters' inner size (thesis: 384)."})
    language_embedding_dim: int = field(default=32, metadata={"help": "d_l, the size of λ⁽ˡ⁾ = V·t⁽ˡ⁾ (thesis: 32)."})
    layer_embeddings: bool = field(
        default=False, metadata={"help": "MAD-G-LS: condition on learned layer embeddings λ⁽ᵇ⁾, W shrinks by n_b/2 (§3.3.2)."}
    )
    layer_embedding_dim: int = field(default=32, metadata={"help": "d_b, the size of λ⁽ᵇ⁾ (MAD-G-LS only; thesis: 32)."})
    target_modules: Optional[Union[list[str], str]] = field(
        default=None, metadata={"help": "Where the adapters sit; None: every block's feed-forward output, found from the model."}
    )
    init_weights: bool = field(
        default=True,
        metadata={"help": "True: the up-projection part of W starts at 0 (every generated adapter is the identity)."},
    )
    modules_to_save: Optional[list[str]] = field(
        default=None, metadata={"help": "Modules trained in full and saved, as in LoRA."}
    )

    def __post_init__(self):
        super().__post_init__()
        self.peft_type = MADG
        for name in ("bottleneck_size", "language_embedding_dim", "layer_embedding_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {name}={value!r}")
        if isinstance(self.languages, str) or not self.languages:
            raise ValueError(f"languages must be a non-empty list of language codes, got languages={self.languages!r}")
        self.languages = [str(x) for x in self.languages]
        if len(set(self.languages)) != len(self.languages):
            raise ValueError(f"languages must be distinct, got languages={self.languages!r}")
        if self.typology_vectors is not None:
            self.typology_vectors = {
                str(k): [float(x) for x in check_vector(k, v).tolist()] for k, v in self.typology_vectors.items()
            }
        for language in self.languages:
            typology_vector(language, self.typology_vectors)  # refuses unknown codes now, not at the first batch
        if isinstance(self.target_modules, (set, tuple)):
            self.target_modules = sorted(self.target_modules)


class MADGGenerator(nn.Module):
    """V, W (and the layer embeddings of MAD-G-LS) with the typology table of the training languages."""

    def __init__(self, config: MADGConfig, hidden_size: int, num_blocks: int, device=None):
        super().__init__()
        self.config, self.hidden_size, self.num_blocks = config, hidden_size, num_blocks
        h, m, d_l, d_b = hidden_size, config.bottleneck_size, config.language_embedding_dim, config.layer_embedding_dim
        d_in = d_l + (d_b if config.layer_embeddings else 0)
        self.register_buffer(
            "typology", torch.stack([typology_vector(x, config.typology_vectors) for x in config.languages]).to(device)
        )
        # scales: λ and λ⁽ᵇ⁾ have entries of O(1/√d), so the generator's input x = λ (⊕ λ⁽ᵇ⁾) has ‖x‖ = O(1) and a
        # generated D has entries of O(1/√h), as a directly initialised adapter; U starts at 0 (the identity)
        self.V = nn.Parameter(torch.randn(d_l, TYPOLOGY_DIM, device=device) / math.sqrt(TYPOLOGY_DIM * d_l))
        shape = (2 * h * m, d_in) if config.layer_embeddings else (num_blocks, 2 * h * m, d_in)
        self.W = nn.Parameter(torch.randn(shape, device=device) / math.sqrt(h))
        if config.init_weights:
            with torch.no_grad():
                self.W[..., h * m :, :].zero_()
        self.layer_embedding = (
            nn.Parameter(torch.randn(num_blocks, d_b, device=device) / math.sqrt(d_b)) if config.layer_embeddings else None
        )
        self.language: Optional[str] = None
        self._vector: Optional[torch.Tensor] = None

    def vector(self, language: str) -> torch.Tensor:
        if language in self.config.languages:
            return self.typology[self.config.languages.index(language)]
        return typology_vector(language, self.config.typology_vectors).to(self.typology.device)

    def set_language(self, language: str) -> None:
        """Generate the adapters of ``language`` from now on (a training language or any other with a vector)."""
        if language != self.language:
            self._vector, self.language = self.vector(language), language

    def language_embedding(self, t: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.V @ (self._current() if t is None else t)  # λ = V·t, (d_l,)

    def _current(self) -> torch.Tensor:
        if self._vector is None:
            raise RuntimeError("MAD-G: no language is set: call the model with language=[...] or set_language('xyz') first")
        return self._vector

    def parameters_of_block(self, block: int, t: Optional[torch.Tensor] = None) -> torch.Tensor:
        """θ⁽ˡ'ᵇ⁾, the (2hm,) parameters of block ``block``'s adapter for typology ``t`` (default: the current language)."""
        lam = self.language_embedding(t)
        if self.layer_embedding is None:
            return self.W[block] @ lam  # Eq. 3.1
        return self.W @ torch.cat([lam, self.layer_embedding[block]])  # Eq. 3.2

    def adapter(self, block: int, t: Optional[torch.Tensor] = None) -> tuple:
        """(D (m, h), U (h, m)) of block ``block``."""
        h, m = self.hidden_size, self.config.bottleneck_size
        theta = self.parameters_of_block(block, t)
        return theta[: h * m].view(m, h), theta[h * m :].view(h, m)

    def feature_importance(self) -> torch.Tensor:
        """‖(W·V)[:, j]‖ for each typological feature j (§3.5.4), (289,): the norm of the generated parameters'
        sensitivity to feature j, through the language-embedding part of W (W's Gram matrix, never W·V itself)."""
        d_l = self.config.language_embedding_dim
        W = self.W.detach()
        W_lang = W[..., :d_l].reshape(-1, d_l)  # (n_p, d_l)
        gram = W_lang.T @ W_lang  # (d_l, d_l)
        V = self.V.detach()
        return ((V * (gram @ V)).sum(0)).clamp_min(0).sqrt()


class MADGLayer(nn.Module, BaseTunerLayer):
    """A frozen module followed by the adapter its block's generator produces for the current language."""

    adapter_layer_names = ()
    other_param_names = ("madg_block",)

    def __init__(self, base_layer: nn.Module, adapter_name: str, block: int, generators: nn.ModuleDict):
        super().__init__()
        self.base_layer = base_layer
        self.in_features, self.out_features = in_out_features(base_layer)
        self.madg_block = {adapter_name: block}
        self.__dict__["_generators"] = generators  # shared with the tuner, which owns (and saves) them
        self._active_adapter = adapter_name
        self.merged_adapters = []

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise ValueError(
            "MAD-G adapters are non-linear and cannot be merged: generate_language_adapter() writes a BOTTLENECK adapter"
        )

    def unmerge(self) -> None:
        pass

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        y = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters:
            return y
        for name in self.active_adapters:
            if name in self.madg_block:
                down, up = self._generators[name].adapter(self.madg_block[name])
                y = bottleneck(y, down, up)
        return y

    def __repr__(self) -> str:
        return "madg." + super().__repr__()


class MADGModel(BaseTuner):
    """PEFT tuner of :class:`MADGConfig`. Call it with ``language=[...]`` (one language per batch)."""

    prefix: str = "madg_"
    tuner_layer_cls = MADGLayer
    target_module_mapping: dict = {}

    def _pre_injection_hook(self, model, config, adapter_name):
        if not hasattr(self, "madg_generator"):
            self.madg_generator = nn.ModuleDict()
            # the language arrives with the model call (PeftModel forwards it to the base model in every task type)
            self._language_hook = model.register_forward_pre_hook(self._route, with_kwargs=True)

    def _route(self, module, args, kwargs):
        if "language" in kwargs:
            names = kwargs.pop("language")
            self.set_language(check_single_language([names] if isinstance(names, str) else list(names)))
        return args, kwargs

    def _unload_and_optionally_merge(self, *args, **kwargs):
        model = super()._unload_and_optionally_merge(*args, **kwargs)
        self._language_hook.remove()
        return model

    def _prepare_adapter_config(self, peft_config, model_config):
        return ffn_targets(self.model, peft_config)

    def _check_merge_allowed(self):
        raise ValueError(
            "MAD-G adapters are non-linear and cannot be merged: generate_language_adapter() writes a BOTTLENECK adapter"
        )

    def _targets(self, config) -> list:
        return [key for key, module in self.model.named_modules() if self._check_target_module_exists(config, key)]

    def _create_and_replace(self, peft_config, adapter_name, target, target_name, parent, current_key, **kwargs):
        if isinstance(target, BaseTunerLayer):
            raise ValueError(f"MAD-G: {current_key} already holds an adapter; one MAD-G generator per model")
        if adapter_name not in self.madg_generator:
            keys = self._targets(peft_config)
            widths = {in_out_features(self.model.get_submodule(k))[1] for k in keys}
            if len(widths) != 1:
                raise ValueError(
                    f"MAD-G: the targeted modules have different output widths {sorted(widths)}; one hidden size is needed"
                )
            self._madg_keys = {**getattr(self, "_madg_keys", {}), adapter_name: keys}
            self.madg_generator[adapter_name] = MADGGenerator(peft_config, widths.pop(), len(keys), device=target.weight.device)
        block = self._madg_keys[adapter_name].index(current_key)
        self._replace_module(parent, target_name, MADGLayer(target, adapter_name, block, self.madg_generator), target)

    def set_adapter(self, adapter_name, inference_mode: bool = False) -> None:
        super().set_adapter(adapter_name, inference_mode=inference_mode)
        active = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        for name, generator in self.madg_generator.items():  # the generators are the adapters' only parameters
            generator.requires_grad_(name in active and not inference_mode)

    def set_language(self, language: str, adapter_name: Optional[str] = None) -> None:
        for name in [adapter_name] if adapter_name else list(self.madg_generator):
            self.madg_generator[name].set_language(language)


def madg_layers(model) -> list:
    """[(module name relative to the base model, MADGLayer)] in block order."""
    return [(n, m) for n, m in model.base_model.model.named_modules() if isinstance(m, MADGLayer)]


@torch.no_grad()
def generate_language_adapter(model, language: str, output_dir: Union[str, os.PathLike], adapter_name: str = "default",
                              typology: Optional[list] = None) -> str:  # fmt: skip
    """Write ``language``'s generated adapter as a standalone ``BOTTLENECK`` adapter directory (adapter_config.json +
    adapter_model.safetensors) and return its path. ``language`` may be unseen in training; ``typology`` gives its
    vector when URIEL has none. The directory loads with ``PeftModel.from_pretrained(base, output_dir)``."""
    config = model.peft_config[adapter_name]
    generator = model.base_model.madg_generator[adapter_name]
    t = check_vector(language, typology).to(generator.typology.device) if typology is not None else generator.vector(language)
    state = {}
    for name, layer in madg_layers(model):
        if adapter_name in layer.madg_block:
            down, up = generator.adapter(layer.madg_block[adapter_name], t)
            state[f"base_model.model.{name}.bottleneck_down.weight"] = down.detach().float().contiguous().cpu()
            state[f"base_model.model.{name}.bottleneck_up.weight"] = up.detach().float().contiguous().cpu()
    out = BottleneckConfig(
        bottleneck_size=config.bottleneck_size, target_modules=config.target_modules,
        use_bias=False, base_model_name_or_path=config.base_model_name_or_path, task_type=config.task_type,
    )  # fmt: skip
    os.makedirs(output_dir, exist_ok=True)
    out.save_pretrained(output_dir)
    save_file(state, os.path.join(output_dir, "adapter_model.safetensors"), metadata={"format": "pt", "language": language})
    return str(output_dir)


def describe_generator(adapter_dir: Union[str, os.PathLike]) -> dict:
    """A saved MAD-G generator: its languages, sizes and each typological feature's importance ‖(W·V)[:, j]‖."""
    from ...core.config import read_adapter_config
    from ...core.storage import read_tensors
    from .typology import feature_names

    raw = read_adapter_config(adapter_dir)
    if raw.get("peft_type") != "MADG":
        raise ValueError(f"{adapter_dir!s} holds a {raw.get('peft_type')} adapter, not a MAD-G generator")
    tensors = {k.rsplit(".", 1)[-1]: v for k, v in read_tensors(adapter_dir).items()}
    d_l = raw["language_embedding_dim"]
    W_lang = tensors["W"].float()[..., :d_l].reshape(-1, d_l)
    V = tensors["V"].float()
    importance = ((V * ((W_lang.T @ W_lang) @ V)).sum(0)).clamp_min(0).sqrt()
    try:
        names = list(feature_names())
    except ImportError:
        names = [f"feature_{j}" for j in range(TYPOLOGY_DIM)]
    return {
        "peft_type": "MADG",
        "variant": "MAD-G-LS" if raw.get("layer_embeddings") else "MAD-G",
        "base_model": raw.get("base_model_name_or_path"),
        "languages": raw["languages"],
        "bottleneck_size": raw["bottleneck_size"],
        "parameters": {k: int(v.numel()) for k, v in tensors.items() if k != "typology"},
        "feature_names": names,
        "importance": importance.tolist(),
    }
