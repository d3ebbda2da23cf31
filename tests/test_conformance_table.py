"""PEFT's generic adapter scenarios as one conformance matrix: one table of rows, many generic tests.

The scenarios are those of PEFT's own generic tester (``PeftCommonTester`` in PEFT's tests/testing_common.py and
the custom-model tests of tests/test_custom_models.py), written anew for this package: the model's attributes and
a named adapter, preparation for training (``enable_input_require_grads``, ``prepare_model_for_kbit_training``),
save/load (safetensors and pickle), selected adapters, adapter names that are substrings of others, ``from_pretrained`` with ``is_trainable``,
low-CPU-memory loading, device maps, multiple adapters, merge / unmerge / safe merge / idempotent merge / fp16
merge / merges of several adapters, NaN detection, ``generate`` (keyword, positional, half precision), training
(with layer indexing, with gradient checkpointing re-entrant and not), ``inputs_embeds``, delete / unload / disable,
mixed-adapter batches (in forward passes, and in beam-search generation), several active adapters, weighted combinations, the base model's state dict and PEFT's
``convert_to_lora``.

A row is (model family, method, targets):

* families (:data:`FAMILIES`): tiny models built offline from configs — an MLP, an MLP with ``modules_to_save``,
  Llama, GPT-2 (Conv1D, tied embeddings), BERT (sequence classification), BART (encoder-decoder) and Qwen2;
* methods (:data:`METHODS`): ``SparseFTConfig``, ``SpIELConfig`` AG and MA, block SpIEL, ``LTSFTConfig`` (its dense
  phase), ``S4Config`` (built as a user does: ``detect_language_masks`` then ``build_s4_model``) and PEFT's
  ``LoraConfig`` as the control: a scenario that fails for LoRA too is the harness's problem, not the method's;
* targets: ``"default"`` (``target_modules=None``: PEFT's default modules for the architecture) or ``"explicit"``.

Every adapter starts away from the identity (``init_weights=False`` / ``init_lora_weights=False``), so merges and
round trips test something. Every cell passes or is skipped with the reason in :data:`SKIPS` (data, not ``if``\\ s).

**What runs** (the whole matrix: about 35 s on two CPU cores): a cell is a (family, method, targets) row crossed
with a scenario (column), and not every crossing runs — those left out repeat what another cell covers:

* the scenarios of :data:`EVERY_CELL` (save/load, merge, training) run on every row: every method with both
  target choices on every family;
* every scenario runs on the rows of :data:`FULL_ROWS` (the MLP, Llama with PEFT's default targets, GPT-2's Conv1D
  with explicit targets), and the scenarios of :data:`SUBSET` on those of :data:`SUBSET_ROWS` (the MLP with
  ``modules_to_save``, BERT, BART, Qwen2 with PEFT's defaults);
* both go over the methods of :data:`REPRESENTATIVE` — all but SpIEL-MA, whose adapter is SpIEL-AG's (the same
  tuner and layers; only the growth criterion of a scheduled run differs, which these scenarios do not run).
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import pickle
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, inject_adapter_in_model, set_peft_model_state_dict
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.lora.conversion import convert_to_lora
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import ModulesToSaveWrapper, get_base_model_state_dict, set_base_model_state_dict
from transformers import BartConfig, BartForConditionalGeneration, Qwen2Config, Qwen2ForCausalLM

from peft_sparse import LTSFTConfig, S4Config, SparseFTConfig, SpIELConfig, build_s4_model, detect_language_masks

from .models import EXPERT_PARAMETERS, tiny_bert, tiny_gpt2, tiny_llama, tiny_mixtral

VOCAB = 97


# ------------------------------------------------------------------------------------------------ model families
class MLP(torch.nn.Module):
    """PEFT's custom-model shape: two linear layers and a head, no transformer (sizes tile 4×4 blocks)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin0, self.lin1, self.head = torch.nn.Linear(12, 20), torch.nn.Linear(20, 20), torch.nn.Linear(20, 2)

    def forward(self, x):
        return self.head(torch.relu(self.lin1(torch.relu(self.lin0(x)))))


def tiny_bart():
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
    )  # fmt: skip
    return BartForConditionalGeneration(config).eval()


def tiny_qwen2():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def _ids(seed: int, batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _lm_inputs(seed: int = 1) -> dict:
    ids = _ids(seed)
    mask = torch.ones_like(ids)
    mask[1, 0] = 0  # (a padded row, as PEFT's inputs have)
    return {"input_ids": ids, "attention_mask": mask}


def _seq2seq_inputs(seed: int = 1) -> dict:
    return {**_lm_inputs(seed), "decoder_input_ids": _ids(seed + 100, length=5)}


@dataclass(frozen=True)
class Family:
    build: Callable[[], torch.nn.Module]
    targets: object  # the explicit target_modules
    task_type: Optional[str]
    inputs: Callable[..., dict]  # keyword arguments of a forward pass
    labels: Optional[Callable[[dict], dict]] = None  # a batch with a loss (training, S⁴'s detection)
    modules_to_save: Optional[list] = None
    generates: bool = False
    positional_generate_raises: bool = False  # PeftModelForSeq2SeqLM.generate takes keyword arguments only
    target_parameters: Optional[list] = None  # parameters adapted beside the modules (a MoE model's fused experts)


def _mlp_inputs(seed: int = 1) -> dict:
    return {"x": torch.randn(4, 12, generator=torch.Generator().manual_seed(seed))}


FAMILIES = {
    "mlp": Family(MLP, ["lin0", "lin1"], None, _mlp_inputs),
    "mlp-mts": Family(MLP, ["lin0", "lin1"], None, _mlp_inputs, modules_to_save=["head"]),
    "llama": Family(tiny_llama, "all-linear", "CAUSAL_LM", _lm_inputs, lambda b: {**b, "labels": b["input_ids"]}, generates=True),
    "gpt2": Family(tiny_gpt2, ["c_attn", "c_proj", "c_fc"], "CAUSAL_LM", _lm_inputs, lambda b: {**b, "labels": b["input_ids"]}, generates=True),
    "bert": Family(tiny_bert, ["query", "key", "value", "dense"], "SEQ_CLS", _lm_inputs, lambda b: {**b, "labels": torch.tensor([0, 2])}),
    "bart": Family(tiny_bart, "all-linear", "SEQ_2_SEQ_LM", _seq2seq_inputs, lambda b: {**b, "labels": b["decoder_input_ids"]},
                   generates=True, positional_generate_raises=True),  # fmt: skip
    "mixtral": Family(tiny_mixtral, ["q_proj", "v_proj"], "CAUSAL_LM", _lm_inputs,
                      lambda b: {**b, "labels": b["input_ids"]}, generates=True, target_parameters=EXPERT_PARAMETERS),  # fmt: skip
    "qwen2": Family(tiny_qwen2, ["q_proj", "k_proj", "v_proj", "o_proj"], "CAUSAL_LM", _lm_inputs, lambda b: {**b, "labels": b["input_ids"]}, generates=True),
}

_BASES: dict = {}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread (several contend for the runner's few cores at ~10 ms an operation)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fresh(family: str, dtype=None) -> torch.nn.Module:
    """A new copy of the family's base model (built once per session: copies are cheaper than inits)."""
    if family not in _BASES:
        _BASES[family] = FAMILIES[family].build()
    model = copy.deepcopy(_BASES[family])
    return model.to(dtype) if dtype is not None else model


# ------------------------------------------------------------------------------------------------ methods
_MASKS: dict = {}


def _s4_masks(family: str, config: S4Config) -> dict:
    """Each language's mask detected on its own batch (kept per family and config: detection is deterministic)."""
    key = (family, json.dumps(config.to_dict(), sort_keys=True, default=str))
    if key not in _MASKS:
        batches = {lang: [FAMILIES[family].labels(FAMILIES[family].inputs(seed=10 + i))] for i, lang in enumerate(config.languages)}
        _MASKS[key] = detect_language_masks(fresh(family), batches, config)
    return {lang: {k: v.clone() for k, v in masks.items()} for lang, masks in _MASKS[key].items()}


def _s4_peft(model, config, family, adapter_name="default"):
    """S⁴ as a user builds it: masks detected on each language's data, then the model over their union."""
    return build_s4_model(model, config, _s4_masks(family, copy.deepcopy(config)), adapter_name=adapter_name)


@dataclass(frozen=True)
class Method:
    config: Callable[..., object]  # (**fields) → a config that starts away from the identity
    peft: Optional[Callable] = None  # (model, config, family, adapter_name) → PeftModel; None: get_peft_model
    merge_tol: float = 1e-5  # merged vs unmerged outputs in float32
    fp16_tol: float = 2e-2
    boost: float = 100.0  # a factor on every adapter parameter that makes greedy generations differ from the base's


METHODS = {
    "sft": Method(lambda **kw: SparseFTConfig(density=0.1, init_weights=False, **kw)),
    "spiel-ag": Method(lambda **kw: SpIELConfig(density=0.1, growth="ag", init_weights=False, **kw)),
    "spiel-ma": Method(lambda **kw: SpIELConfig(density=0.1, growth="ma", init_weights=False, **kw)),
    "spiel-block": Method(lambda **kw: SpIELConfig(density=0.1, block_shape=(4, 4), init_weights=False, **kw)),
    "lt-sft": Method(lambda **kw: LTSFTConfig(density=0.1, init_weights=False, **kw)),
    "s4": Method(lambda **kw: S4Config(density=0.2, languages=["a", "b"], importance_batches=1, init_weights=False, **kw), peft=_s4_peft),
    "lora": Method(lambda **kw: LoraConfig(r=4, init_lora_weights=False, **kw), merge_tol=1e-4, boost=10.0),  # (×10 on each factor)
}

# ------------------------------------------------------------------------------------------------ skips (data)
_NO_DEFAULT = "PEFT has no default target modules for a custom model (model_type 'custom'): target_modules=None cannot apply"
_S4_DATA = ("S⁴'s indices come from per-language detection on data (build_s4_model makes a new model of them): "
            "add_adapter with a config alone makes a placeholder adapter that refuses to run until a saved one is loaded")
_NO_LOSS = "S⁴ detects its masks from the model's loss on each language's data; the custom MLP returns no loss"
_MTS_COMBINE = "a dense modules_to_save copy cannot be combined into a weighted adapter (LoRA refuses overlapping ones too)"
_NO_LAYERS = "the MLP has no numbered layers for layers_to_transform"
_NOT_TRANSFORMERS = "the custom MLP is not a transformers model: it has no generate, no input embeddings, no gradient checkpointing"
_PARAMETER_MIXED = ("PEFT runs no mixed adapter_names batch through target_parameters (LoRA's ParamWrapper refuses it); the "
                    "sparse adapters refuse it by name as well (tests/test_moe.py)")
_PARAMETER_CONVERSION = ("PEFT's convert_to_lora writes modules only: adapters on target_parameters, LoRA's as well, report "
                         "no conversion support (merge is the route; tests/test_moe.py)")
_CLASSIFIER = "a sequence classifier (BertForSequenceClassification) does not generate"

# (method, family, targets, scenario) patterns (fnmatch) → reason; the first match wins
SKIPS = {
    ("*", "mlp*", "default", "*"): _NO_DEFAULT,
    ("s4", "mlp*", "*", "*"): _NO_LOSS,
    ("*", "mlp*", "*", "generate*"): _NOT_TRANSFORMERS,
    ("*", "mlp*", "*", "inputs_embeds"): _NOT_TRANSFORMERS,
    ("*", "mlp*", "*", "gradient_checkpointing*"): _NOT_TRANSFORMERS,
    ("*", "mlp*", "*", "layer_indexing"): _NO_LAYERS,
    ("*", "mlp*", "*", "prepare_for_training"): _NOT_TRANSFORMERS,
    ("s4", "*", "*", "second_adapter:*"): _S4_DATA,
    ("*", "bert", "*", "generate*"): _CLASSIFIER,
    ("*", "mlp-mts", "*", "weighted_combination"): _MTS_COMBINE,
    ("*", "bert", "*", "weighted_combination"): _MTS_COMBINE,  # (SEQ_CLS: PEFT saves the classifier as modules_to_save)
    ("*", "mixtral", "*", "mixed_adapter_batches"): _PARAMETER_MIXED,
    ("*", "mixtral", "*", "generate_mixed_batches_beam_search"): _PARAMETER_MIXED,
    ("*", "mixtral", "*", "lora_conversion"): _PARAMETER_CONVERSION,
    ("lora", "mixtral", "*", "weighted_combination"): "PEFT's add_weighted_adapter refuses LoRA adapters on nn.Parameter targets",
}
# scenarios that make a second adapter from the row's config (add_adapter) carry this tag for the skip table
SECOND_ADAPTER = {"selected_adapters", "adapter_name_substring", "merge_multi", "delete_adapter", "weighted_combination",
                  "mixed_adapter_batches", "multiple_active_adapters", "generate_mixed_batches_beam_search"}  # fmt: skip

# which cells run (module docstring): scenarios on every row; rows with every scenario; rows with the subset
EVERY_CELL = {"save_pretrained[safetensors]", "merge", "training"}
FULL_ROWS = {("mlp", "explicit"), ("llama", "default"), ("gpt2", "explicit")}
SUBSET_ROWS = {("mlp-mts", "explicit"), ("bert", "default"), ("bart", "default"), ("qwen2", "default"), ("mixtral", "default")}
SUBSET = {"from_pretrained_is_trainable", "selected_adapters", "merge_multi", "safe_merge_nan", "gradient_checkpointing[non-reentrant]",
          "generate", "generate_mixed_batches_beam_search", "disable_adapter", "inputs_embeds", "weighted_combination", "delete_adapter[active]",
          "unload", "lora_conversion", "model_attributes", "mixed_adapter_batches"}  # fmt: skip
REPRESENTATIVE = ("sft", "spiel-ag", "spiel-block", "lt-sft", "s4", "lora")


@dataclass(frozen=True)
class Cell:
    family: str
    method: str
    targets: str  # "default" (target_modules=None) or "explicit"

    @property
    def id(self) -> str:
        return f"{self.family}-{self.method}-{self.targets}"

    @property
    def fam(self) -> Family:
        return FAMILIES[self.family]

    def config(self, **overrides):
        fam = self.fam
        fields = {"target_modules": None if self.targets == "default" else fam.targets, "task_type": fam.task_type}
        if fam.modules_to_save:
            fields["modules_to_save"] = list(fam.modules_to_save)
        if fam.target_parameters:
            fields["target_parameters"] = list(fam.target_parameters)
        return METHODS[self.method].config(**{**fields, **overrides})

    def peft(self, model=None, config=None, adapter_name="default"):
        """The row's adapter on a fresh base model (or on ``model``)."""
        model = fresh(self.family) if model is None else model
        config = self.config() if config is None else config
        build = METHODS[self.method].peft
        if build is None:
            return get_peft_model(model, config, adapter_name=adapter_name)
        return build(model, config, self.family, adapter_name)

    def inputs(self, seed: int = 1, repeat: int = 1) -> dict:
        batch = self.fam.inputs(seed)
        return {k: torch.cat([v] * repeat) for k, v in batch.items()}

    def out(self, model, inputs=None) -> torch.Tensor:
        output = model(**(inputs if inputs is not None else self.inputs()))
        return output if isinstance(output, torch.Tensor) else output.logits


CELLS = [Cell(f, m, t) for f in FAMILIES for m in METHODS for t in ("default", "explicit")]


def _skip_reason(cell: Cell, scenario: str) -> Optional[str]:
    tags = [scenario] + ([f"second_adapter:{scenario}"] if scenario in SECOND_ADAPTER else [])
    for (m, f, t, s), reason in SKIPS.items():
        if fnmatch.fnmatch(cell.method, m) and fnmatch.fnmatch(cell.family, f) and fnmatch.fnmatch(cell.targets, t):
            if any(fnmatch.fnmatch(tag, s) for tag in tags):
                return reason
    return None


def _runs(cell: Cell, scenario: str) -> bool:
    if scenario in EVERY_CELL:
        return True
    row = (cell.family, cell.targets)
    return cell.method in REPRESENTATIVE and (row in FULL_ROWS or (row in SUBSET_ROWS and scenario in SUBSET))


def cells(scenario: str, variants: tuple = ()):
    """The cells of one scenario (column) as pytest parameters — ``cell``, or ``(cell, variant)`` for a scenario with
    variants; a skipped cell carries its reason."""
    out = []
    for variant in variants or (None,):
        name = f"{scenario}[{variant}]" if variant else scenario
        for cell in CELLS:
            if not _runs(cell, name):
                continue
            reason = _skip_reason(cell, scenario)
            marks = pytest.mark.skip(reason=reason) if reason else ()
            values = (cell, variant) if variants else (cell,)
            out.append(pytest.param(*values, id=f"{cell.id}-{variant}" if variant else cell.id, marks=marks))
    return out


def _adapter_parameters(model) -> dict:
    return {n: p for n, p in model.named_parameters() if model.prefix in n or "modules_to_save" in n}


def _layer_holds(module, name) -> bool:
    """Whether a tuner layer keeps anything of adapter ``name`` (any of its per-adapter containers)."""
    for attr in getattr(module, "adapter_layer_names", ()) + getattr(module, "other_param_names", ()):
        container = getattr(module, attr, None)
        if hasattr(container, "keys") and name in container.keys():
            return True
    return False


def _close(a, b, tol) -> bool:
    return torch.allclose(a, b, rtol=tol, atol=tol)


def _apart(a, b, base) -> bool:
    """``a`` and ``b`` differ by more than a tenth of what the adapter moved ``a`` from the base model's ``base``
    (a scale that holds for small outputs, e.g. a randomly initialized classifier's)."""
    return bool((a - b).abs().max() > 0.1 * (a - base).abs().max())


# ------------------------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("cell", cells("model_attributes"))
def test_model_attributes_and_adapter_name(cell):
    model = cell.peft(adapter_name="test-adapter")
    assert all(hasattr(model, a) for a in ("save_pretrained", "from_pretrained", "push_to_hub"))
    assert model.active_adapters == ["test-adapter"] and list(model.peft_config) == ["test-adapter"]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("test-adapter" in n for n in names)


@pytest.mark.parametrize("cell", cells("prepare_for_training"))
def test_prepare_for_training(cell):
    """The embeddings' output needs no gradient until ``enable_input_require_grads`` (gradient checkpointing's need);
    after ``prepare_model_for_kbit_training`` every base parameter is frozen and the adapter alone trains."""
    from peft import prepare_model_for_kbit_training

    ids = cell.inputs()["input_ids"]
    model = cell.peft()
    assert not model.get_input_embeddings()(ids).requires_grad
    base = prepare_model_for_kbit_training(fresh(cell.family))
    assert not any(p.requires_grad for p in base.parameters())
    model = cell.peft(base)
    model.enable_input_require_grads()
    assert model.get_input_embeddings()(ids).requires_grad
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(_adapter_parameters(model))


# ------------------------------------------------------------------------------------------------ save and load
@pytest.mark.parametrize("cell, variant", cells("save_pretrained", ("safetensors", "pickle")))
def test_save_pretrained(cell, variant, tmp_path):
    safe = variant == "safetensors"
    model = cell.peft().eval()
    model.save_pretrained(tmp_path, safe_serialization=safe)
    files = set(os.listdir(tmp_path))
    assert ("adapter_model.safetensors" if safe else "adapter_model.bin") in files and "adapter_config.json" in files
    assert not {"model.safetensors", "config.json"} & files
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = PeftModel.from_pretrained(fresh(cell.family), tmp_path).eval()
    assert not any("Found missing adapter keys" in str(w.message) for w in caught)
    state, again = model.state_dict(), loaded.state_dict()
    assert state.keys() == again.keys()
    assert all(torch.equal(state[k], again[k]) for k in state)
    with torch.no_grad():
        assert torch.equal(cell.out(model), cell.out(loaded))


@pytest.mark.parametrize("cell", cells("selected_adapters"))
def test_save_pretrained_selected_adapters(cell, tmp_path):
    model = cell.peft()
    model.add_adapter("new_adapter", cell.config())
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(fresh(cell.family), tmp_path)
    loaded.load_adapter(tmp_path / "new_adapter", "new_adapter")
    state, again = model.state_dict(), loaded.state_dict()
    assert state.keys() == again.keys() and all(torch.equal(state[k], again[k]) for k in state)
    only = tmp_path / "only"
    model.save_pretrained(only, selected_adapters=["default"])
    loaded = PeftModel.from_pretrained(fresh(cell.family), only)
    assert "default" in loaded.peft_config and "new_adapter" not in loaded.peft_config


@pytest.mark.parametrize("cell", cells("adapter_name_substring"))
def test_save_pretrained_adapter_name_substring(cell, tmp_path):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    model = cell.peft()
    expected = len(get_peft_model_state_dict(model))
    for name in ("default2", "other_default", "foodefault_bar", "efaul"):  # prefix, suffix, infix, substring
        model.add_adapter(name, cell.config())
    model.save_pretrained(tmp_path, selected_adapters=["default"])
    assert len(load_file(tmp_path / "adapter_model.safetensors")) == expected


@pytest.mark.parametrize("cell", cells("from_pretrained_is_trainable"))
def test_from_pretrained_is_trainable(cell, tmp_path):
    model = cell.peft()
    model.save_pretrained(tmp_path)
    config = copy.deepcopy(model.peft_config["default"])
    frozen = PeftModel.from_pretrained(fresh(cell.family), tmp_path, is_trainable=False, config=config)
    assert frozen.peft_config["default"] is config and config.inference_mode
    assert not any(p.requires_grad for p in frozen.parameters())
    trainable = PeftModel.from_pretrained(fresh(cell.family), tmp_path, is_trainable=True)
    assert not trainable.peft_config["default"].inference_mode
    params = _adapter_parameters(trainable)
    assert params and all(p.requires_grad for p in params.values())
    cell.out(trainable.train()).float().pow(2).mean().backward()
    assert all(p.grad is not None for p in params.values() if p.requires_grad)


@pytest.mark.parametrize("cell", cells("low_cpu_mem_usage"))
def test_load_with_low_cpu_mem_usage(cell, tmp_path):
    model = cell.peft().eval()
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(fresh(cell.family), tmp_path, low_cpu_mem_usage=True).eval()
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    loaded.load_adapter(tmp_path, adapter_name="other", low_cpu_mem_usage=True)
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    with torch.no_grad():
        assert torch.equal(cell.out(loaded), cell.out(model))
    base = fresh(cell.family)
    inject_adapter_in_model(copy.deepcopy(model.peft_config["default"]), base, low_cpu_mem_usage=True)
    assert "meta" in {p.device.type for p in base.parameters()}


@pytest.mark.parametrize("cell", cells("device_map"))
def test_from_pretrained_with_a_device_map(cell, tmp_path):
    model = cell.peft().eval()
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(fresh(cell.family), tmp_path, device_map={"": "cpu"}).eval()
    with torch.no_grad():
        assert torch.equal(cell.out(loaded), cell.out(model))


@pytest.mark.parametrize("cell", cells("load_multiple_adapters"))
def test_load_multiple_adapters(cell, tmp_path):
    cell.peft().save_pretrained(tmp_path)
    model = PeftModel.from_pretrained(fresh(cell.family), tmp_path)
    for name in ("other", "yet-another"):
        assert model.load_adapter(tmp_path, adapter_name=name).missing_keys == []


# ------------------------------------------------------------------------------------------------ merging
@pytest.mark.parametrize("cell", cells("merge"))
def test_merge_unmerge_and_merge_and_unload(cell, tmp_path):
    tol = METHODS[cell.method].merge_tol
    model = cell.peft().eval()
    with torch.no_grad():
        adapted = cell.out(model)
        model.merge_adapter()
        merged = cell.out(model)
        model.unmerge_adapter()
        unmerged = cell.out(model)
        unloaded = model.merge_and_unload()
        assert not any(isinstance(m, BaseTunerLayer) for m in unloaded.modules()) and not hasattr(unloaded, "peft_config")
        final = cell.out(unloaded)
        assert _close(adapted, merged, tol) and _close(adapted, unmerged, tol) and _close(adapted, final, tol)
        assert not _close(final, cell.out(fresh(cell.family)), 1e-6)  # (the adapter acts)
        if hasattr(unloaded, "save_pretrained"):
            unloaded.save_pretrained(tmp_path)
            again = type(unloaded).from_pretrained(tmp_path).eval()
        else:
            again = pickle.loads(pickle.dumps(unloaded))
        assert _close(cell.out(again), final, tol)


@pytest.mark.parametrize("cell", cells("merge_fp16"))
def test_merge_in_float16(cell):
    model = cell.peft(fresh(cell.family, torch.float16)).to(torch.float16).eval()
    inputs = {k: v.half() if v.is_floating_point() else v for k, v in cell.inputs().items()}
    with torch.no_grad():
        adapted = cell.out(model, inputs)
        merged = cell.out(model.merge_and_unload(), inputs)
    assert merged.dtype == torch.float16 and _close(merged.float(), adapted.float(), METHODS[cell.method].fp16_tol)


@pytest.mark.parametrize("cell", cells("merge_idempotent"))
def test_merging_twice_changes_nothing(cell):
    model = cell.peft().eval()
    with torch.no_grad():
        model.merge_adapter()
        first = cell.out(model)
        with pytest.warns(UserWarning, match="All adapters are already merged, nothing to do"):
            model.merge_adapter()
        assert _close(cell.out(model), first, 1e-6)


@pytest.mark.parametrize("cell", cells("safe_merge"))
def test_safe_merge(cell, tmp_path):
    from safetensors.torch import save_model

    model = cell.peft().eval()
    with torch.no_grad():
        base = cell.out(fresh(cell.family))
        adapted = cell.out(model)
        assert not _close(adapted, base, 1e-6)
        unloaded = model.merge_and_unload(safe_merge=True)
        assert _close(cell.out(unloaded), adapted, METHODS[cell.method].merge_tol)
    torch.save(unloaded.state_dict(), tmp_path / "model.bin")
    save_model(unloaded, str(tmp_path / "model.safetensors"))  # (contiguous tensors; tied weights saved once)


@pytest.mark.parametrize("cell", cells("safe_merge_nan"))
def test_safe_merge_detects_nan_and_inf(cell):
    for bad in (torch.nan, torch.inf):
        model = cell.peft().eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if model.prefix in name:
                    param.view(-1)[0] = bad
        with pytest.raises(ValueError, match="NaNs detected in the merged weights. The adapter default seems to be broken"):
            model.merge_and_unload(safe_merge=True)


@pytest.mark.parametrize("cell", cells("merge_multi"))
def test_merge_several_adapters(cell):
    """Two adapters from one config differ (torch.manual_seed decides their values); merging both is neither, merging
    one is that one."""
    tol = 1e-4
    base = fresh(cell.family)
    with torch.no_grad():
        plain = cell.out(base)
    torch.manual_seed(0)
    model = cell.peft(base).eval()
    with torch.no_grad():
        first = cell.out(model)
    torch.manual_seed(1)
    model.add_adapter("adapter-2", cell.config())
    model.set_adapter("adapter-2")
    model.eval()
    containers = (torch.nn.ModuleDict, torch.nn.ParameterDict, BufferDict)
    count = lambda name: len([m for m in model.modules() if isinstance(m, containers) and name in m])  # noqa: E731
    assert count("default") > 0 and count("default") == count("adapter-2")
    with torch.no_grad():
        second = cell.out(model)
        assert _apart(first, second, plain)
        model.set_adapter("default")
        assert _close(cell.out(model), first, tol)
        copy_2, copy_default = copy.deepcopy(model), copy.deepcopy(model)
        both = cell.out(model.merge_and_unload(adapter_names=["adapter-2", "default"]))
        assert _apart(both, first, plain) and _apart(both, second, plain)
        assert _close(cell.out(copy_2.merge_and_unload(adapter_names=["adapter-2"])), second, tol)
        assert _close(cell.out(copy_default.merge_and_unload(adapter_names=["default"])), first, tol)


@pytest.mark.parametrize("cell", cells("multiple_active_adapters"))
def test_several_active_adapters_add_their_deltas(cell):
    model = cell.peft().eval()
    torch.manual_seed(1)
    model.add_adapter("other", cell.config())
    with torch.no_grad():
        alone = cell.out(model)
        model.base_model.set_adapter(["default", "other"])
        both = cell.out(model)
        assert not _close(both, alone, 1e-4)
        merged = cell.out(model.merge_and_unload(adapter_names=["default", "other"]))
    assert _close(merged, both, 1e-4)


@pytest.mark.parametrize("cell", cells("mixed_adapter_batches"))
def test_mixed_adapter_batches(cell):
    """Each row gets its adapter's output — its delta and its own copy of the modules_to_save (made to differ)."""
    model = cell.peft().eval()
    torch.manual_seed(1)
    model.add_adapter("adapter1", cell.config())
    x = cell.inputs(repeat=3)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, ModulesToSaveWrapper):
                for head in module.modules_to_save.values():
                    for param in head.parameters():
                        param.add_(torch.randn_like(param) * 0.1)
        with model.disable_adapter():
            base = cell.out(model, x)
        model.set_adapter("default")
        first = cell.out(model, x)
        model.set_adapter("adapter1")
        second = cell.out(model, x)
        assert _apart(first, base, base) and _apart(second, base, base) and _apart(first, second, base)
        names = ["__base__", "default", "adapter1"]
        rows = len(next(iter(x.values())))
        mixed = cell.out(model, {**x, "adapter_names": [names[i % 3] for i in range(rows)]})
    for i, expected in enumerate((base, first, second)):
        assert _close(mixed[i::3], expected[i::3], 1e-4)


@pytest.mark.parametrize("cell", cells("weighted_combination"))
def test_weighted_combination_is_the_weighted_sum_of_the_deltas(cell):
    """δ = Σ wᵢ·δᵢ, with positive and negative weights (LoRA: combination_type='cat', its exact combination)."""
    extra = {"combination_type": "cat"} if cell.method == "lora" else {}
    for weights in ([0.5, 1.5], [-0.5, -1.2]):
        model = cell.peft()
        torch.manual_seed(1)
        model.add_adapter("other", cell.config())
        model.add_weighted_adapter(["default", "other"], weights, "combined", **extra)
        layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer) and _layer_holds(m, "combined")]
        assert layers
        for layer in layers:
            want = weights[0] * layer.get_delta_weight("default") + weights[1] * layer.get_delta_weight("other")
            torch.testing.assert_close(layer.get_delta_weight("combined"), want, rtol=1e-5, atol=1e-6)
        model.set_adapter("combined")
        with torch.no_grad():
            assert not _close(cell.out(model.eval()), cell.out(fresh(cell.family)), 1e-6)


# ------------------------------------------------------------------------------------------------ generation
@pytest.mark.parametrize("cell", cells("generate"))
def test_generate(cell):
    model = cell.peft().eval()
    inputs = cell.inputs()
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=3, do_sample=False)
        if cell.fam.positional_generate_raises:
            with pytest.raises(TypeError):
                model.generate(inputs["input_ids"])
        else:  # (min_new_tokens: an end-of-sequence token drawn by a random model does not stop it early)
            out = model.generate(inputs["input_ids"], max_new_tokens=3, min_new_tokens=3, do_sample=False)
            assert out.shape[1] == inputs["input_ids"].shape[1] + 3


@pytest.mark.parametrize("cell", cells("generate_mixed_batches_beam_search"))
def test_generate_with_mixed_adapter_batches_and_beam_search(cell):
    """Each row of a mixed batch generates, under beam search, what its adapter (or the base model) gives alone."""
    torch.manual_seed(0)
    model = cell.peft(adapter_name="adapter0").eval()
    torch.manual_seed(1)
    model.add_adapter("adapter1", cell.config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if model.prefix in name:
                param.mul_(METHODS[cell.method].boost)  # (stronger adapters: greedy choices differ from the base's)
    x = cell.inputs(repeat=3)
    rows = len(x["input_ids"])
    kwargs = {**x, "max_new_tokens": 4, "min_new_tokens": 4, "num_beams": 3, "do_sample": False}
    with torch.no_grad():
        with model.disable_adapter():
            alone = {"__base__": model.generate(**kwargs)}
        for name in ("adapter0", "adapter1"):
            model.set_adapter(name)
            alone[name] = model.generate(**kwargs)
        assert not torch.equal(alone["adapter0"], alone["adapter1"])
        names = [["__base__", "adapter0", "adapter1"][i % 3] for i in range(rows)]
        mixed = model.generate(**kwargs, adapter_names=names)
    for i, name in enumerate(names):
        assert torch.equal(mixed[i], alone[name][i]), (i, name)


@pytest.mark.parametrize("cell", cells("generate_half_precision"))
def test_generate_in_bfloat16(cell):
    model = cell.peft(fresh(cell.family, torch.bfloat16)).eval()
    ids = torch.tensor([[4, 4, 4], [5, 4, 5]])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.tensor([[1, 1, 1], [1, 0, 1]]), max_new_tokens=3, do_sample=False)
    assert out.shape[0] == 2


@pytest.mark.parametrize("cell", cells("disable_adapter"))
def test_disable_adapter(cell):
    """Inside ``disable_adapter()`` the base model's outputs (generation scores for generative models), after it the
    adapter's again."""

    def output(model):
        if cell.fam.generates:
            return model.generate(**cell.inputs(), max_new_tokens=2, do_sample=False, return_dict_in_generate=True, output_scores=True).scores[0]
        return cell.out(model)

    with torch.no_grad():
        before = output(fresh(cell.family).eval())
        model = cell.peft().eval()
        adapted = output(model)
        assert not torch.allclose(before, adapted)
        with model.disable_adapter():
            assert _close(output(model), before, 1e-6)
        assert _close(output(model), adapted, 1e-6)


# ------------------------------------------------------------------------------------------------ training
@pytest.mark.parametrize("cell", cells("training"))
def test_training_updates_the_adapter_alone_and_round_trips(cell, tmp_path):
    model = cell.peft().train()
    cell.out(model).float().pow(2).sum().backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    for n, p in model.named_parameters():
        if model.prefix in n or "modules_to_save" in n:
            assert (p.grad is not None) == p.requires_grad, n
        else:
            assert p.grad is None, n
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    optimizer.step()
    optimizer.zero_grad()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != (n in trainable), n
    model.eval()
    with torch.no_grad():
        trained = cell.out(model)
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(fresh(cell.family), tmp_path).eval()
    with torch.no_grad():
        assert _close(cell.out(loaded), trained, 1e-6)


@pytest.mark.parametrize("cell", cells("layer_indexing"))
def test_training_with_layers_to_transform(cell, tmp_path):
    model = cell.peft(config=cell.config(layers_to_transform=[0])).train()
    cell.out(model).float().sum().backward()
    adapter = _adapter_parameters(model)
    assert adapter and all(p.grad is not None for p in adapter.values())
    assert all(p.grad is None for n, p in model.named_parameters() if n not in adapter)
    assert all(".0." in n for n in adapter if model.prefix in n)  # layer 0 alone
    model.eval()
    with torch.no_grad():
        out = cell.out(model)
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        assert _close(cell.out(PeftModel.from_pretrained(fresh(cell.family), tmp_path).eval()), out, 1e-6)
    assert len(adapter) < len(_adapter_parameters(cell.peft()))


@pytest.mark.parametrize("cell, variant", cells("gradient_checkpointing", ("reentrant", "non-reentrant")))
def test_training_with_gradient_checkpointing(cell, variant):
    reentrant = variant == "reentrant"
    model = cell.peft().train()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    inputs = cell.inputs()
    (cell.out(model, inputs) ** 2).sum().backward()
    plain = {n: p.grad.clone() for n, p in params.items()}
    for p in params.values():
        p.grad = None
    model.prepare_model_for_gradient_checkpointing(model)
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    (cell.out(model, inputs) ** 2).sum().backward()
    assert {n for n, g in plain.items() if g.abs().sum() > 0} == {n for n, p in params.items() if p.grad.abs().sum() > 0}
    for n, p in params.items():
        torch.testing.assert_close(p.grad, plain[n], rtol=1e-4, atol=1e-6)
    assert all(p.grad is None for n, p in model.named_parameters() if n not in params)


@pytest.mark.parametrize("cell", cells("inputs_embeds"))
def test_forward_with_inputs_embeds(cell):
    model = cell.peft().eval()
    inputs = cell.inputs()
    with torch.no_grad():
        embeds = model.get_input_embeddings()(inputs["input_ids"])
        out = cell.out(model, {**{k: v for k, v in inputs.items() if k != "input_ids"}, "inputs_embeds": embeds})
        assert _close(out, cell.out(model, inputs), 1e-5)


# ------------------------------------------------------------------------------------------------ removing adapters
def _holds(model, name) -> bool:
    return any(_layer_holds(module, name) for module in model.modules())


@pytest.mark.parametrize("cell, variant", cells("delete_adapter", ("active", "inactive")))
def test_delete_adapter(cell, variant):
    model = cell.peft()
    model.add_adapter("delete_me", cell.config())
    if variant == "active":
        model.set_adapter("delete_me")
    model.delete_adapter("delete_me")
    assert "delete_me" not in model.peft_config and model.active_adapters == ["default"] and not _holds(model, "delete_me")
    with pytest.raises(ValueError, match="Adapter unknown-adapter does not exist"):
        model.delete_adapter("unknown-adapter")
    model.delete_adapter("default")
    assert "default" not in model.peft_config and model.active_adapters == [] and not _holds(model, "default")
    with torch.no_grad():
        model.base_model(**cell.inputs())


@pytest.mark.parametrize("cell", cells("unload"))
def test_unload_gives_the_base_model_back(cell):
    base = fresh(cell.family).eval()
    keys = len(base.state_dict())
    with torch.no_grad():
        plain = cell.out(base)
        model = cell.peft(base).eval()
        adapted = cell.out(model)
        unloaded = model.unload()
        assert not any(isinstance(m, BaseTunerLayer) for m in unloaded.modules()) and not hasattr(unloaded, "peft_config")
        out = cell.out(unloaded)
    assert not _close(out, adapted, 1e-10) and torch.equal(out, plain) and len(unloaded.state_dict()) == keys


@pytest.mark.parametrize("cell", cells("base_model_state_dict"))
def test_base_model_state_dict(cell):
    base = fresh(cell.family)
    original = {k: v.clone() for k, v in base.state_dict().items()}
    model = cell.peft(base)
    extracted = get_base_model_state_dict(model)
    assert extracted.keys() == original.keys()
    assert all(torch.equal(original[k], extracted[k]) for k in original)
    with torch.no_grad():
        for param in model.get_base_model().parameters():
            if param.is_floating_point() and not param.requires_grad:
                param.add_(torch.randn_like(param) * 0.1)
    result = set_base_model_state_dict(model, original, strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    restored = get_base_model_state_dict(model)
    assert all(torch.equal(original[k], restored[k]) for k in original)


# ------------------------------------------------------------------------------------------------ conversion to LoRA
@pytest.mark.parametrize("cell", cells("lora_conversion"))
def test_conversion_to_lora(cell):
    """PEFT's convert_to_lora: at full rank (energy threshold 1.0) the LoRA gives the adapter's outputs; at rank 4 it
    loads with no unexpected key and moves the outputs the adapter's way."""
    model = cell.peft().eval()
    assert model.supports_lora_conversion()
    with torch.no_grad():
        adapted = cell.out(model)
        base = cell.out(fresh(cell.family))
    for rank in (1.0, 4):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (LoRA's own: "already a LoRA adapter"; Conv1D's fan_in_fan_out)
            lora_config, state = convert_to_lora(model, rank=rank)
            lora = get_peft_model(fresh(cell.family), lora_config).eval()
        assert not set_peft_model_state_dict(lora, state).unexpected_keys
        with torch.no_grad():
            out = cell.out(lora)
        if rank == 1.0:
            assert _close(out, adapted, 1e-4)
        else:
            assert torch.nn.functional.mse_loss(out - base, adapted - base) < 0.5
