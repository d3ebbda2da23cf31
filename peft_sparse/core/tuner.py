"""``SparseTuner``: the PEFT ``BaseTuner`` shared by every sparse method.

It plans the budget over the matched modules, wraps each in a :class:`SparseLinear`, asks the
method's policy for the initial indices, keeps ``values_dtype`` as configured, validates adapter
files on load and composes adapters (``add_weighted_adapter``). A method subclasses it with a
``prefix`` and an ``initial_indices`` policy; nothing else differs between methods here.
"""

from __future__ import annotations

import contextlib
import weakref
from abc import abstractmethod

import torch
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from peft.utils.other import AuxiliaryTrainingWrapper, _get_submodules
from torch import nn

from ..registry import ExcludedModule, include_all_linear_layers
from . import dispatch, storage
from .budget import split_budget, split_weights, total_budget
from .config import SparseConfig, dtype_name
from .embedding import SparseEmbedding
from .experts import SparseParameter, matched_parameters, parameter_owner, slice_names
from .base import index_dtype, logical_shape, supported_base_layer, unsupported_embedding_reason
from .layer import SparseLayer, SparseLinear
from .merging import merged_for_inference
from .selection import BlockGrid, check_sparse_tensors, module_generator
from .targets import _display_name, _model_configs, parameter_targets, resolve_default_targets, target_matches  # noqa: F401 (re-exported)


def initial_values(config: SparseConfig, count: int) -> torch.Tensor:
    """The ``count`` values φ a new adapter starts with (float32, CPU): 0, or with ``init_weights=False`` N(0, 0.02²)
    draws from torch's global generator — ``torch.manual_seed`` decides them, as for LoRA's
    ``init_lora_weights=False``, so two adapters made from one config differ while their indices (``config.seed``
    and the module name) are the same."""
    if config.init_weights:
        return torch.zeros(count)
    return torch.randn(count).mul_(0.02)


class SparseTuner(BaseTuner):
    tuner_layer_cls = SparseLayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    #: methods whose indices change during training keep per-index ages (SpIEL)
    dynamic: bool = False

    def __setstate__(self, state):
        # a copy (copy.deepcopy, unpickling) holds copies of the layers, whose model reference still names
        # the original model (a weak reference copies as itself): point them at this copy's model, which
        # they check for other users of their base weights before merging in place
        super().__setstate__(state)
        model = self._modules.get("model")
        if model is not None:
            ref = weakref.ref(model)
            for module in model.modules():
                if isinstance(module, SparseLayer):
                    module._model_ref = ref

    # ------------------------------------------------------------------------------- the policy
    @abstractmethod
    def initial_indices(self, config: SparseConfig, layer: SparseLayer, module_name: str, count: int) -> torch.Tensor:
        """Sorted flat indices (CPU int64) into ``layer``'s logical (out, in) matrix (whole blocks)."""

    @staticmethod
    def grid(config: SparseConfig, layer: SparseLayer) -> BlockGrid:
        return BlockGrid(layer.out_features, layer.in_features, config.block_shape)

    # ------------------------------------------------------------------------------- injection
    @staticmethod
    def _check_target_module_exists(peft_config, key):
        return target_matches(peft_config, key)

    def _matched_modules(self, config: SparseConfig, model: nn.Module) -> dict[str, nn.Module]:
        """The modules this adapter will wrap, in model order (same rules as PEFT's injection loop)."""
        existing = [key + "." for key, module in model.named_modules() if isinstance(module, (BaseTunerLayer, SparseParameter))]
        matched = {}
        for key, module in model.named_modules():
            if not key or any(key.startswith(prefix) for prefix in existing):
                continue
            result = target_matches(config, key)
            if result and not isinstance(result, ExcludedModule):
                matched[key] = module
        return matched

    def _prepare_adapter_config(self, peft_config, model_config: dict):
        return resolve_default_targets(peft_config, model_config.get("model_type"))

    def _check_tied_modules(self, model: nn.Module, peft_config) -> None:
        """A targeted input embedding that shares its weight with an output layer (tied word embeddings) is untied
        first (``untie_output_embeddings``): the output layer keeps θ₀ in a frozen copy of its own, so the delta
        reaches the input lookup alone, merged or not. Then PEFT's own check runs on the untied model.

        PEFT calls this before it fills in default target modules, so ``target_modules=None`` is resolved first."""
        resolve_default_targets(peft_config, self.get_model_config(model).get("model_type"))
        for key, module in model.named_modules():
            result = target_matches(peft_config, key) if key else None
            if not isinstance(module, nn.Embedding) or not result or isinstance(result, ExcludedModule):
                continue
            weight = module.weight
            sharing = [k for k, m in model.named_modules() if m is not module and m._parameters.get("weight") is weight]
            if not sharing:
                continue
            if not getattr(peft_config, "untie_output_embeddings", True):
                raise ValueError(
                    f"target module {key!r} shares its weight with {sharing} (tied word embeddings), so its delta would "
                    "change those outputs once merged but not before: set untie_output_embeddings=True, or leave the "
                    "embedding out of target_modules"
                )
            for name in sharing:
                owner = model.get_submodule(name)
                owner.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
            for config in {id(c): c for c in _model_configs(model)}.values():
                config.tie_word_embeddings = False
        super()._check_tied_modules(model, peft_config)

    def _prepare_model(self, peft_config: SparseConfig, model: nn.Module) -> None:
        """Fix the exact number of tunable weights of every matched module before any is wrapped."""
        include_all_linear_layers(peft_config, model)
        if peft_config.base_vocab_size is None and hasattr(model, "get_input_embeddings"):
            embeddings = model.get_input_embeddings()
            embeddings = embeddings.get_base_layer() if isinstance(embeddings, BaseTunerLayer) else embeddings
            if isinstance(embeddings, nn.Embedding):
                peft_config.base_vocab_size = embeddings.num_embeddings
        matched = self._matched_modules(peft_config, model)
        sizes, shapes = matched_parameters(peft_config, model)
        for key in matched:
            if f"{key}.weight" in sizes:
                raise ValueError(
                    f"target_parameters names {key + '.weight'!r}, the weight of a module that target_modules adapts "
                    "already: adapt it one way, e.g. leave it out of target_parameters (a bias may be named beside it)"
                )
        for key, module in matched.items():
            base = parameter_owner(module)
            if not supported_base_layer(base):
                reason = unsupported_embedding_reason(base)
                if reason:
                    raise TypeError(f"target module {key!r} is an embedding that sparse adapters don't support: {reason}")
                raise TypeError(
                    f"target module {key!r} is a {type(base).__name__}, which sparse adapters don't support; "
                    "supported are torch.nn.Linear, torch.nn.Embedding, transformers Conv1D and bitsandbytes Linear4bit"
                )
            out_features, in_features = logical_shape(base)
            bh, bw = peft_config.block_shape
            if out_features % bh or in_features % bw:
                raise ValueError(
                    f"block_shape={peft_config.block_shape} does not tile target module {key!r} of shape "
                    f"({out_features}, {in_features})"
                )
            sizes[key] = out_features * in_features
            shapes[key] = [out_features, in_features]
        if not sizes:
            return  # PEFT raises its own "target modules not found" error
        counts = peft_config.tunable_weights_per_module
        if counts is None:
            unit = peft_config.block_shape[0] * peft_config.block_shape[1]
            budget = total_budget(sum(sizes.values()), peft_config.density, peft_config.num_tunable_weights, unit)
            weights = split_weights(shapes, peft_config.budget_split)
            peft_config.tunable_weights_per_module = split_budget(sizes, budget, unit, weights)
            peft_config.module_shapes = shapes
            return
        for key, shape in (peft_config.module_shapes or {}).items():
            if key in shapes and list(shape) != shapes[key]:
                raise ValueError(
                    f"{key}: the adapter was made for a {tuple(shape)} matrix but the model's is {tuple(shapes[key])}"
                )
        if set(counts) != set(sizes):
            missing, extra = sorted(set(sizes) - set(counts)), sorted(set(counts) - set(sizes))
            raise ValueError(
                "tunable_weights_per_module does not match the targeted modules: "
                f"targeted but without a count: {missing}; counted but not targeted: {extra}"
            )
        unit = peft_config.block_shape[0] * peft_config.block_shape[1]
        for key, count in counts.items():
            if count % unit:
                raise ValueError(f"tunable_weights_per_module[{key!r}]={count} is not a whole number of {peft_config.block_shape} blocks")
            if count > sizes[key]:
                raise ValueError(
                    f"tunable_weights_per_module[{key!r}]={count} exceeds the module's {sizes[key]} weights"
                )
        if peft_config.num_tunable_weights is not None and sum(counts.values()) != peft_config.num_tunable_weights:
            raise ValueError(
                f"tunable_weights_per_module sums to {sum(counts.values())} but "
                f"num_tunable_weights={peft_config.num_tunable_weights}"
            )

    def _create_and_replace(self, peft_config, adapter_name, target, target_name, parent, current_key, **kwargs) -> list:
        """Wrap ``target`` (or, with ``parameter_name``, its parameter of that name: :mod:`.experts`) and add the
        adapter; returns the sparse layers that received it."""
        if kwargs.get("parameter_name") is not None:
            return self._create_and_replace_parameter(peft_config, adapter_name, target, target_name, parent, current_key, kwargs["parameter_name"])
        holder = None  # the innermost wrapper of the module's bias (target_parameters), when there is one
        while isinstance(target, SparseParameter):
            holder, target = target, target.base_layer
        if isinstance(target, SparseLayer):
            layer = target
        elif isinstance(target, nn.Embedding):
            layer = SparseEmbedding(target, module_name=current_key)
        else:
            layer = SparseLinear(target, module_name=current_key)
        if peft_config.training_merge:
            layer.merge_for_training = True
        self._add_adapter(peft_config, adapter_name, layer, current_key, fresh=layer is not target)
        if layer is not target:
            if holder is not None:  # (under the bias's wrapper, which reads the owner through it)
                holder.base_layer = layer
            else:
                self._replace_module(parent, target_name, layer, target)
        return [layer]

    def _inject_parameters(self, peft_config, model: nn.Module, adapter_name: str, low_cpu_mem_usage: bool) -> list[str]:
        """``target_parameters``: PEFT's matching (exact name or suffix, wrappers' ``base_layer`` left out of the name),
        with a bias of a module whose weight a sparse layer adapts allowed (its wrapper wraps that layer)."""
        layers = tuple(key for key, m in model.named_modules() if isinstance(m, SparseLayer))
        found = list(parameter_targets(peft_config, model, skip=layers))
        for key, _, name in found:
            module_name = key.rpartition(".")[0]
            if not module_name:
                raise ValueError(f"target_parameters: {key!r} is a parameter of the top-level module, which cannot be wrapped")
            parent, target, target_name = _get_submodules(model, module_name)
            self._create_and_replace(peft_config, adapter_name, target, target_name, parent, current_key=key, parameter_name=name)
        return [key for key, _, _ in found]

    def _create_and_replace_parameter(self, peft_config, adapter_name, target, target_name, parent, current_key, name) -> list:
        """``target_parameters``: the wrapper of ``target``'s parameter ``name`` (nested over wrappers of its other
        parameters, or the one an earlier adapter made) gets the adapter on each of its slices."""
        counts = peft_config.tunable_weights_per_module
        wrapper = self.model.get_submodule(current_key.rpartition(".")[0])
        while isinstance(wrapper, SparseParameter) and wrapper.parameter_name != name:
            wrapper = wrapper.base_layer
        fresh = not isinstance(wrapper, SparseParameter)
        if fresh:
            owner = parameter_owner(target)
            if any(key not in counts for key in slice_names(current_key, owner._parameters[name])):
                return []  # (left out by layers_to_transform)
            wrapper = SparseParameter(target, name, current_key)
            setattr(parent, target_name, wrapper)
        for layer in wrapper.slices:
            self._add_adapter(peft_config, adapter_name, layer, layer.module_name, fresh)
        return list(wrapper.slices)

    def _add_adapter(self, peft_config, adapter_name: str, layer: SparseLayer, key: str, fresh: bool) -> None:
        """Give ``layer`` the adapter: its count from the config, initial indices from the policy, zero values
        (``fresh``: a layer made for it, frozen unless the adapter is active)."""
        count = peft_config.tunable_weights_per_module[key]
        # lets the layer check, whenever it would merge in place, that no other parameter shares the base weight
        layer._model_ref = weakref.ref(self.model)
        external = peft_config.init == "external"
        if external:  # placeholders until the adapter file is loaded (see SparseLayer._check_ready)
            indices = torch.arange(count, dtype=torch.long)
        else:
            indices = self.initial_indices(peft_config, layer, key, count)
        layer.update_layer(
            adapter_name,
            indices,
            peft_config.torch_values_dtype,
            inference_mode=peft_config.inference_mode,
            with_ages=self.dynamic,
            indices_pending=external,
            block_shape=peft_config.block_shape,
        )
        if peft_config.budget_split == "adaptive":
            layer.resizable_adapters.add(adapter_name)
        if not peft_config.init_weights and not external:
            values = layer.sparse_values[adapter_name]
            with torch.no_grad():
                values.copy_(initial_values(peft_config, values.numel()))
        if fresh and adapter_name not in self.active_adapters:
            layer.requires_grad_(False)

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        # PEFT would upcast float16/bfloat16 adapter weights to float32; the values keep values_dtype instead. An
        # unset values_dtype is float32, or — autocast_adapter_dtype=False, as PEFT means it — the base weights'
        # floating dtype (the first adapted module's; quantized bases: float32); the choice goes into the config.
        config = self.peft_config.get(adapter_name)
        layers = [m for m in self.model.modules() if isinstance(m, SparseLayer) and adapter_name in m.sparse_values]
        if config is not None and getattr(config, "values_dtype", "") is None:
            dtype = torch.float32
            if not autocast_adapter_dtype:
                floating = [w.dtype for m in layers if (w := getattr(m.get_base_layer(), "weight", None)) is not None and w.dtype.is_floating_point]
                dtype = floating[0] if floating else torch.float32
            config.values_dtype = dtype_name(dtype)
            for layer in layers:
                layer.values_dtype[adapter_name] = dtype
        for layer in self.model.modules():
            if isinstance(layer, SparseLayer) and adapter_name in layer.sparse_values:
                param = layer.sparse_values[adapter_name]
                wanted = layer.values_dtype[adapter_name]
                if param.dtype != wanted:
                    layer.sparse_values[adapter_name] = nn.Parameter(param.data.to(wanted), requires_grad=param.requires_grad)
                    layer._register_values(adapter_name)

    def _replace_module(self, parent, child_name, new_module, child) -> None:
        if isinstance(child, SparseParameter):  # (unloading: the module that owns the parameter goes back as it is)
            setattr(parent, child_name, new_module)
            return
        super()._replace_module(parent, child_name, new_module, child)

    def _unload_and_optionally_merge(self, *args, **kwargs):
        # unload()/merge_and_unload() hand the base layers back: θ₀ first where an adapter is merged for training
        for layer in self.model.modules():
            if isinstance(layer, SparseLayer):
                layer.release_training_merge()
        return super()._unload_and_optionally_merge(*args, **kwargs)

    # ------------------------------------------------------------------------------- generation
    _mixed_batch = False  # (True while a mixed-batch call's hooks are in place: see below)

    def generate(self, *args, **kwargs):
        """The base model's ``generate``. On the fast paths the active adapters are merged in place for the call
        (:func:`~peft_sparse.merged_for_inference`: the d_φ entries they overwrite are kept and written back bit
        for bit afterwards, also on an error), so each decoding step is the base model's own and the tokens are
        the merged model's. A mixed batch (``adapter_names``) and ``peft_sparse.fast_paths(False)`` generate
        with the adapters unmerged, every layer adding its delta in each pass."""
        if dispatch.ON and not self._mixed_batch:
            with merged_for_inference(self.model):
                return self.model.generate(*args, **kwargs)
        return self.model.generate(*args, **kwargs)

    # ------------------------------------------------------------------------------- mixed batches
    @contextlib.contextmanager
    def _enable_peft_forward_hooks(self, *args, **kwargs):
        """``model(..., adapter_names=[name per row])``: each row gets its own adapter's delta ("__base__": none),
        in inference as PEFT's LoRA does. Beam search repeats each row's name ``num_beams`` times."""
        adapter_names = kwargs.pop("adapter_names", None)
        if adapter_names is None:
            yield
            return
        if self.training:
            raise ValueError("Cannot pass `adapter_names` when the model is in training mode.")
        if isinstance(adapter_names, str) or not all(isinstance(n, str) for n in adapter_names):
            raise TypeError(f"adapter_names must be a list of adapter names, one per row, got {adapter_names!r}")
        wrapped = [m.key for m in self.model.modules() if isinstance(m, SparseParameter)]
        if wrapped:
            raise ValueError(f"mixed adapter batches (adapter_names) are not supported for target_parameters (nor by PEFT's "
                             f"LoRA there), e.g. {wrapped[0]}: run one adapter per batch, or merge")  # fmt: skip
        layers = [m for m in self.model.modules() if isinstance(m, SparseLayer)]
        known = {a for layer in layers for a in layer.sparse_values}
        unknown = sorted({n for n in adapter_names if n != "__base__"} - known)
        if unknown:
            raise ValueError(f"Trying to infer with non-existing adapter(s): {', '.join(unknown)}")
        rows = list(adapter_names)
        beams = kwargs.get("num_beams")
        if isinstance(beams, int) and beams > 1:  # generate repeats each row num_beams times: the decoder's batch
            adapter_names = [n for n in adapter_names for _ in range(beams)]
        names = list(adapter_names)
        # an encoder-decoder's encoder runs once on the rows as given, before beam search repeats them
        encoder = self.model.get_encoder() if hasattr(self.model, "get_encoder") else None
        in_encoder = set() if encoder is None or encoder is self.model else {id(m) for m in encoder.modules()}

        def inject(module, args, kw):
            kw["adapter_names"] = rows if id(module) in in_encoder else names
            return args, kw

        # the sparse layers and PEFT's modules_to_save copies (each row its adapter's copy, as with LoRA)
        routed = [m for m in self.model.modules() if isinstance(m, (SparseLayer, AuxiliaryTrainingWrapper))]
        handles = [module.register_forward_pre_hook(inject, with_kwargs=True) for module in routed]
        self._mixed_batch = True  # (generate keeps the adapters unmerged: each row adds its own delta)
        try:
            yield
        finally:
            self._mixed_batch = False
            for handle in handles:
                handle.remove()

    # ------------------------------------------------------------------------------- saving and loading
    @classmethod
    def _get_adapter_state_dict(cls, model, config, adapter_name, state_dict, unwanted_adapter_names):
        """What ``save_pretrained`` writes (format: :mod:`peft_sparse.core.storage`): each tensor's positions in the
        smallest form (``index_storage``), the values in the dtype asked for, the ages only when asked."""
        out = super()._get_adapter_state_dict(model, config, adapter_name, state_dict, unwanted_adapter_names)
        options = storage.current_save_options()
        # the values in save_pretrained(values_dtype=...) or the config's values_dtype: an exact cast always (DeepSpeed's
        # bf16/fp16 engines hand over values cast down from float32 masters, widened back here — the same however the
        # state dict was built: ZeRO-3 consolidates its own, without module hooks), a lossy one only when allowed
        wanted = options.values_dtype or getattr(config, "torch_values_dtype", None)
        asked = (
            f"save_pretrained(values_dtype={storage.dtype_label(options.values_dtype)!r})" if options.values_dtype is not None
            else f"the config's values_dtype={getattr(config, 'values_dtype', None)!r} (adapter {adapter_name!r})"
        )
        for key in [k for k in out if storage.AGES + "." in k or k.endswith(storage.AGES)]:
            if options.save_ages:
                out[key] = storage.narrow_ages(out[key])
            else:
                del out[key]  # (a training diagnostic: the scheduler's checkpoint state keeps it for resuming)
        for key, tensor in out.items():
            if wanted is not None and key.endswith(f".sparse_values.{adapter_name}") and tensor.is_floating_point():
                what = _display_name(key.removesuffix(f".sparse_values.{adapter_name}"))
                out[key] = storage.cast_values(tensor, wanted, options.allow_lossy_cast, what, asked)

        def numel_of(key: str) -> int:
            module = model.get_submodule(key.split(storage.LIST)[0].removeprefix("_fsdp_wrapped_module."))
            return module.numel

        return storage.encode(out, numel_of, getattr(config, "index_storage", "list"))

    @classmethod
    def _remap_adapter_state_dict_for_load(cls, model, config, adapter_name, state_dict):
        state_dict = super()._remap_adapter_state_dict_for_load(model, config, adapter_name, storage.decode(state_dict))
        for name, layer in model.named_modules():
            if not isinstance(layer, SparseLayer) or adapter_name not in layer.sparse_values:
                continue
            where = layer.module_name
            idx_key, val_key = f"{name}.sparse_indices.{adapter_name}", f"{name}.sparse_values.{adapter_name}"
            if idx_key not in state_dict or val_key not in state_dict:
                raise ValueError(f"{where}: the adapter file holds no indices/values for this module")
            indices, values = state_dict[idx_key], state_dict[val_key]
            check_sparse_tensors(
                where,
                indices,
                values,
                layer.numel,
                # (an adaptive adapter takes the file's sizes: its load pre-hook resizes the layer)
                expected_count=None if adapter_name in layer.resizable_adapters else layer.sparse_values[adapter_name].numel(),
                index_dtype=index_dtype(layer.numel),
                values_dtype=layer.values_dtype[adapter_name],
            )
            age_key = f"{name}.sparse_ages.{adapter_name}"
            if adapter_name in layer.sparse_ages:
                if age_key in state_dict:
                    state_dict[age_key] = storage.widen_ages(state_dict[age_key], indices.numel(), where)
                else:  # an adapter saved without ages: every index counts as initial (age 0), also for training on
                    state_dict[age_key] = torch.zeros(indices.numel(), dtype=torch.int32)
            layer._indices_pending.discard(adapter_name)
            counts = getattr(config, "tunable_weights_per_module", None)
            if adapter_name in layer.resizable_adapters and counts and layer.module_name in counts:
                counts[layer.module_name] = int(indices.numel())  # (the sizes the load gives the layer)
        return state_dict

    # ------------------------------------------------------------------------------- composition
    def add_weighted_adapter(self, adapters: list[str], weights: list[float], adapter_name: str) -> None:
        """New adapter δ = Σ wᵢ·δᵢ: on each sparse layer the union of the indices, with the weighted values summed
        (:func:`peft_sparse.core.compose.add_weighted_adapter`). Merging it gives θ + Σ wᵢ·δᵢ."""
        from .compose import add_weighted_adapter

        add_weighted_adapter(self, adapters, weights, adapter_name)
