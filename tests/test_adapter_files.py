"""Adapter files: each tensor's positions in the smallest of three forms (index list, bitmap, Elias–Fano), exact
round-trips, the size against the information in the mask, values in the dtype asked for, ages only when asked,
and older files loading to identical models."""

import os

import numpy as np
import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file

from peft_sparse import S4Config, SparseFTConfig, SparseLayer, SpIELConfig, SpIELScheduler, build_s4_model, load_sparse_adapter, merge_sparse_adapters
from peft_sparse.core import edit, storage

from .models import inputs, randomize_values, sparse_layers, tiny_llama

FIXTURES = os.path.join(os.path.dirname(__file__), "data", "adapter_files")
OLD_FILES = ["sft_list", "sft_bitmap_bf16", "spiel_ages", "sft_blocks_list", "s4_masks"]
FORMS = ("list", "bitmap", "elias-fano")
DENSITIES = [0.001, 0.01, 0.046, 0.2, 0.5, 1.0]


def _held(model, adapter_name: str = "default") -> dict:
    out = {}
    for layer in model.modules():
        if isinstance(layer, SparseLayer) and adapter_name in layer.sparse_values:
            name = layer.module_name
            out[f"{name}::indices"] = layer.sparse_indices[adapter_name]
            out[f"{name}::values"] = layer.sparse_values[adapter_name].detach()
            if adapter_name in layer.sparse_ages:
                out[f"{name}::ages"] = layer.sparse_ages[adapter_name]
            if adapter_name in layer.sparse_masks:
                out[f"{name}::masks"] = layer.sparse_masks[adapter_name]
    return out


def _assert_identical(expected: dict, held: dict, skip=()) -> None:
    keys = sorted(k for k in expected if k.rsplit("::", 1)[1] not in skip)
    assert keys == sorted(k for k in held if k.rsplit("::", 1)[1] not in skip)
    for key in keys:
        assert held[key].dtype == expected[key].dtype and torch.equal(held[key], expected[key]), key


def _random_mask(numel: int, density: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    count = round(numel * density)
    return torch.randperm(numel, generator=g)[:count].sort().values.to(torch.int32 if numel < 2**31 else torch.int64)


def _roundtrip(indices: torch.Tensor, numel: int, form: str) -> tuple[torch.Tensor, dict]:
    key = "base_model.model.layer.sparse_indices.default"
    encoded = storage.encode({key: indices, "base_model.model.layer.sparse_values.default": torch.zeros(indices.numel())}, lambda k: numel, form)
    decoded = storage.decode(encoded)
    return decoded[key], encoded


# ------------------------------------------------------------------------------------------------ the positions
@pytest.mark.parametrize("form", [*FORMS, "auto"])
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("numel", [2**20, 1000 * 1001 + 3])
def test_random_masks_round_trip_exactly_in_every_form(form, density, numel):
    indices = _random_mask(numel, density, seed=int(density * 1000))
    decoded, encoded = _roundtrip(indices, numel, form)
    assert decoded.dtype == torch.int32 and torch.equal(decoded, indices)
    assert all(t.dtype in (torch.uint8, torch.int64, torch.int32, torch.float32) for t in encoded.values())


@pytest.mark.parametrize("form", [*FORMS, "auto"])
@pytest.mark.parametrize("case", ["empty", "first", "last", "pair"])
def test_empty_and_single_index_tensors_round_trip(form, case):
    numel = 4099
    indices = {"empty": [], "first": [0], "last": [numel - 1], "pair": [0, numel - 1]}[case]
    indices = torch.tensor(indices, dtype=torch.int32)
    decoded, _ = _roundtrip(indices, numel, form)
    assert decoded.dtype == torch.int32 and torch.equal(decoded, indices)


def test_tensors_of_2_to_the_31_weights_and_more_round_trip_with_int64_indices():
    """Logical shapes past int32 indices (a 65,536 × 65,536 matrix and a 2³⁴-weight one), as the layer would hold
    them: Elias–Fano never touches an N-sized buffer, and 'auto' never chooses the bitmap there."""
    g = torch.Generator().manual_seed(0)
    for numel in (2**32, 2**34):
        indices = torch.unique(torch.randint(0, numel, (20_000,), generator=g))  # (sorted, int64)
        assert storage.choose(indices.numel(), numel, 8, "auto") == "elias-fano"
        for form in ("list", "elias-fano", "auto"):
            decoded, encoded = _roundtrip(indices, numel, form)
            assert decoded.dtype == torch.int64 and torch.equal(decoded, indices)
        header = next(t for k, t in encoded.items() if k.endswith("sparse_index_header.default"))
        assert header.tolist()[0] == numel
    assert _roundtrip(torch.tensor([2**31 - 1], dtype=torch.int64), 2**31, "elias-fano")[0].dtype == torch.int64
    assert _roundtrip(torch.tensor([2**31 - 2], dtype=torch.int32), 2**31 - 1, "elias-fano")[0].dtype == torch.int32


@pytest.mark.parametrize("density", [0.001, 0.01, 0.046, 0.2])
def test_elias_fano_is_within_1_2_of_the_information_in_a_random_mask(density):
    """log2 C(N, n) bits tell a uniformly random choice of n positions out of N; Elias–Fano (its header included)
    takes at most 1.2× that from density 0.1% to 20% (the goal is 1.5×), and 'auto' never more than Elias–Fano."""
    numel = 2**20
    indices = _random_mask(numel, density, seed=3)
    _, encoded = _roundtrip(indices, numel, "elias-fano")
    bits = 8 * sum(t.numel() * t.element_size() for k, t in encoded.items() if "sparse_index_" in k)
    bound = storage.entropy_bits(indices.numel(), numel)
    assert bits <= 1.2 * bound
    _, auto = _roundtrip(indices, numel, "auto")
    assert 8 * sum(t.numel() * t.element_size() for k, t in auto.items() if "sparse_index" in k) <= bits


def test_auto_stays_within_1_25_of_the_information_up_to_density_one_half():
    numel = 2**20
    for k in range(1, 501, 7):
        count = round(numel * k / 1000)
        sizes = storage.storage_bytes(count, numel, 4)
        assert 8 * sizes[storage.choose(count, numel, 4, "auto")] <= 1.25 * storage.entropy_bits(count, numel), k


def test_elias_fano_round_trips_at_every_lower_bit_width():
    """ℓ from 0 to 55 (tensors of about n·2^ℓ weights): fields of every width, those straddling two 64-bit words
    included, and counts that leave the last row of 8 fields short."""
    g = torch.Generator().manual_seed(7)
    widths = set()
    for width in range(storage.MAX_LOWER_BITS + 1):
        for count in (1, 8, 13, 67):
            numel = count << width
            indices = torch.unique(torch.randint(0, numel, (count,), generator=g, dtype=torch.int64))
            upper, lower, header = storage.elias_fano_encode(indices, numel)
            widths.add(header.tolist()[2])
            decoded = storage.elias_fano_decode(upper, lower, header, "layer")
            assert torch.equal(decoded.long(), indices), (width, count)
    assert widths >= set(range(storage.MAX_LOWER_BITS))


def test_the_numpy_reader_of_the_format_page_reads_elias_fano():
    """The few numpy lines of docs/adapter-files.md (and of the storage module) decode a file without peft_sparse."""
    numel = 300_007
    indices = _random_mask(numel, 0.03, seed=5)
    _, encoded = _roundtrip(indices, numel, "elias-fano")
    upper, lower, header = (encoded[f"base_model.model.layer.sparse_index_{p}.default"].numpy() for p in ("upper", "lower", "header"))
    N, n, l = header
    bits = np.unpackbits(upper, bitorder="little")
    high = np.flatnonzero(bits)[:n] - np.arange(n)
    low_bits = np.unpackbits(lower, bitorder="little")[: n * l].reshape(n, l).astype(np.int64)
    got = (high << l) | (low_bits << np.arange(l)).sum(1)
    assert N == numel and np.array_equal(got, indices.numpy())


@pytest.mark.parametrize(
    "edit_file, match",
    [
        (lambda t, k: t.pop(k + "upper"), "holds an Elias–Fano header but not both bit strings"),
        (lambda t, k: t.pop(k + "header"), "holds an Elias–Fano bit string but no header"),
        (lambda t, k: t.__setitem__(k + "header", torch.tensor([10, 30, 1])), "invalid Elias–Fano header numel=10, count=30, lower_bits=1"),
        (lambda t, k: t.__setitem__(k + "header", t[k + "header"].int()), "an Elias–Fano header must be int64"),
        (lambda t, k: t.__setitem__(k + "upper", torch.cat([t[k + "upper"], torch.tensor([1], dtype=torch.uint8)])), "bytes of upper bits, expected"),
        (lambda t, k: t.__setitem__(k + "upper", t[k + "upper"] | 1), "the upper bit string marks"),
        (lambda t, k: t.__setitem__(k + "lower", t[k + "lower"][:-1]), "bytes of lower bits, expected"),
    ],
)
def test_a_damaged_elias_fano_code_is_refused_with_the_module_named(edit_file, match):
    indices = _random_mask(10_000, 0.05)
    _, encoded = _roundtrip(indices, 10_000, "elias-fano")
    prefix = "base_model.model.layer.sparse_index_"
    moved = {k.removesuffix(".default"): v for k, v in encoded.items()}
    edit_file(moved, prefix)
    with pytest.raises(ValueError, match=match) as info:
        storage.decode(moved)
    assert str(info.value).startswith("layer")


def test_a_bitmap_of_another_dtype_is_refused_with_the_module_named():
    bits = storage.pack(torch.tensor([1, 5, 9]), 16)
    with pytest.raises(ValueError, match=r"layer: a bitmap of positions must be 1-D uint8, got torch.int16 \(2,\)"):
        storage.decode({"base_model.model.layer.sparse_index_bits": bits.to(torch.int16)})
    assert storage.decode({"base_model.model.layer.sparse_index_bits": bits})["base_model.model.layer.sparse_indices"].tolist() == [1, 5, 9]


# ------------------------------------------------------------------------------------------------ through PEFT
def _save_and_load(model, path, form, **save_kwargs):
    for config in model.peft_config.values():
        config.index_storage = form
    model.save_pretrained(path, **save_kwargs)
    return PeftModel.from_pretrained(tiny_llama(), path)


@pytest.mark.parametrize("form", [*FORMS, "auto"])
@pytest.mark.parametrize("density", [0.01, 0.2, 1.0])
def test_sft_adapters_round_trip_bit_identically(tmp_path, form, density):
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=density, seed=2))
    randomize_values(model)
    loaded = _save_and_load(model, tmp_path, form)
    _assert_identical(_held(model), _held(loaded))
    x = inputs()
    assert torch.equal(loaded(x).logits, model(x).logits)


@pytest.mark.parametrize("form", [*FORMS, "auto"])
@pytest.mark.parametrize("block_shape", [(16, 16), (1, 8)])
def test_block_adapters_round_trip_bit_identically(tmp_path, form, block_shape):
    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.25, block_shape=block_shape, growth="ma"))
    randomize_values(model)
    loaded = _save_and_load(model, tmp_path, form)
    _assert_identical(_held(model), _held(loaded), skip=("ages",))
    assert loaded.peft_config["default"].block_shape == block_shape


@pytest.mark.parametrize("form", [*FORMS, "auto"])
def test_adaptive_budgets_round_trip_with_their_sizes_an_emptied_tensor_included(tmp_path, form):
    """budget_split='adaptive': tensors of other sizes than the split gave them (one emptied, one grown), saved
    and loaded into a model built from the saved config, and into one built from the original config."""
    config = dict(target_modules="all-linear", density=0.1, budget_split="adaptive")
    model = get_peft_model(tiny_llama(), SpIELConfig(**config))
    layers = sparse_layers(model)
    g = torch.Generator().manual_seed(1)
    emptied, grown = layers[0], layers[3]
    sources, new = [], []
    for layer in (emptied, grown):
        old = layer.sparse_indices["default"].long()
        if layer is emptied:
            sources.append(torch.zeros(0, dtype=torch.long))
            new.append(torch.zeros(0, dtype=torch.long))
        else:
            extra = torch.tensor(sorted(set(torch.randperm(layer.numel, generator=g)[:60].tolist()) - set(old.tolist())))
            merged = torch.cat([old, extra]).sort()
            sources.append(torch.cat([torch.arange(old.numel()), torch.full((extra.numel(),), -1)])[merged.indices])
            new.append(merged.values)
    edit.resize_slots([emptied, grown], "default", sources, new, step=9)
    model.peft_config["default"].tunable_weights_per_module.update({emptied.module_name: 0, grown.module_name: grown.sparse_values["default"].numel()})
    randomize_values(model)
    assert emptied.sparse_values["default"].numel() == 0
    loaded = _save_and_load(model, tmp_path, form, save_ages=True)
    _assert_identical(_held(model), _held(loaded))
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    fresh = get_peft_model(tiny_llama(), SpIELConfig(**config))
    set_peft_model_state_dict(fresh, load_peft_weights(str(tmp_path)))
    _assert_identical(_held(model), _held(fresh))


def _s4_model():
    config = S4Config(target_modules="all-linear", density=0.05, languages=["a", "b", "c"], importance_batches=1)
    g = torch.Generator().manual_seed(4)
    base = tiny_llama()
    masks = {
        lang: {name: torch.randperm(m.weight.numel(), generator=g)[: m.weight.numel() // 20].sort().values
               for name, m in base.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"}
        for lang in config.languages
    }  # fmt: skip
    model = build_s4_model(tiny_llama(), config, masks)
    randomize_values(model)
    return model


@pytest.mark.parametrize("form", [*FORMS, "auto"])
def test_s4_masks_round_trip_bit_identically(tmp_path, form):
    model = _s4_model()
    loaded = _save_and_load(model, tmp_path, form)
    _assert_identical(_held(model), _held(loaded))


@pytest.mark.parametrize("form", [*FORMS, "auto"])
def test_composed_adapters_round_trip_bit_identically(tmp_path, form):
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.05, seed=1), adapter_name="lang")
    model.add_adapter("task", SparseFTConfig(target_modules=["q_proj", "down_proj"], density=0.1, seed=2))
    randomize_values(model, "lang", seed=1)
    randomize_values(model, "task", seed=2)
    model.add_weighted_adapter(["lang", "task"], [1.0, -0.5], "both")
    for config in model.peft_config.values():
        config.index_storage = form
    model.save_pretrained(tmp_path, selected_adapters=["both"])
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "both", adapter_name="both")
    _assert_identical(_held(model, "both"), _held(loaded, "both"))


def test_the_main_jobs_shape_of_adapter_is_smaller_than_with_bitmaps(tmp_path):
    """At LoRA r16's budget over all-linear (4.6%; the tiny model's tensors), the Elias–Fano positions ('auto')
    take less than half the bitmaps' bytes, and the file holds no ages."""
    sizes = {}
    for form in ("bitmap", "auto"):
        model = get_peft_model(tiny_llama(hidden_size=128, intermediate_size=384), SpIELConfig(target_modules="all-linear", density=0.046))
        model.peft_config["default"].index_storage = form
        model.save_pretrained(tmp_path / form)
        tensors = load_file(tmp_path / form / "adapter_model.safetensors")
        assert not any("sparse_ages" in k for k in tensors)
        sizes[form] = sum(t.numel() * t.element_size() for k, t in tensors.items() if "sparse_index" in k)
    assert sizes["auto"] < 0.5 * sizes["bitmap"]


# ------------------------------------------------------------------------------------------------ older files
@pytest.mark.parametrize("name", OLD_FILES)
def test_files_of_the_list_and_bitmap_format_load_to_identical_models(name):
    """Files written by the format that stored positions as int32 lists or bitmaps and ages as int32 (committed in
    tests/data/adapter_files, with the tensors the model held when it saved them)."""
    directory = os.path.join(FIXTURES, name)
    expected = load_file(os.path.join(directory, "expected.safetensors"))
    model = PeftModel.from_pretrained(tiny_llama(), directory)
    _assert_identical(expected, _held(model))


@pytest.mark.parametrize("name", ["sft_list", "spiel_ages", "sft_bitmap_bf16"])
def test_older_files_merge_and_load_as_another_type_and_save_again_in_the_new_form(name, tmp_path):
    directory = os.path.join(FIXTURES, name)
    expected = load_file(os.path.join(directory, "expected.safetensors"))
    as_sft = load_sparse_adapter(tiny_llama(), directory)
    _assert_identical(expected, _held(as_sft), skip=("ages",))
    x = inputs()
    merged = merge_sparse_adapters(tiny_llama(), [directory])
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, as_sft(x).logits, rtol=1e-5, atol=1e-5)
    model = PeftModel.from_pretrained(tiny_llama(), directory)
    model.save_pretrained(tmp_path, save_ages=True)
    resaved = load_file(tmp_path / "adapter_model.safetensors")
    assert any("sparse_index_upper" in k for k in resaved) == (name != "sft_bitmap_bf16")  # (that config asks for bitmaps)
    _assert_identical(expected, _held(PeftModel.from_pretrained(tiny_llama(), tmp_path)))


# ------------------------------------------------------------------------------------------------ ages
def _spiel_with_ages(largest: int):
    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1))
    randomize_values(model)
    g = torch.Generator().manual_seed(2)
    for layer in sparse_layers(model):
        ages = layer.sparse_ages["default"]
        ages.copy_(torch.randint(0, largest + 1, ages.shape, generator=g, dtype=torch.int32))
        ages[0] = largest
    return model


def test_a_plain_save_holds_no_ages_and_loads_them_as_zero(tmp_path):
    model = _spiel_with_ages(60)
    model.save_pretrained(tmp_path)
    assert not any("sparse_ages" in k for k in load_file(tmp_path / "adapter_model.safetensors"))
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path, is_trainable=True)
    _assert_identical(_held(model), _held(loaded), skip=("ages",))
    assert all(l.sparse_ages["default"].dtype == torch.int32 and not l.sparse_ages["default"].any() for l in sparse_layers(loaded))
    # loaded over an adapter of the same name that had ages: they are reset, not left stale
    model.load_adapter(str(tmp_path), "default", is_trainable=True)
    assert all(not l.sparse_ages["default"].any() for l in sparse_layers(model))


@pytest.mark.parametrize("largest, dtype", [(60, torch.uint8), (255, torch.uint8), (256, torch.int16), (32767, torch.int16), (32768, torch.int32)])
def test_save_ages_writes_them_in_the_narrowest_integer_dtype_and_they_load_exactly(tmp_path, largest, dtype):
    model = _spiel_with_ages(largest)
    model.save_pretrained(tmp_path, save_ages=True)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    ages = [t for k, t in tensors.items() if k.endswith("sparse_ages")]
    assert len(ages) == len(sparse_layers(model)) and {t.dtype for t in ages} == {dtype}
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    _assert_identical(_held(model), _held(loaded))


def test_bad_saved_ages_are_refused_with_the_module_named(tmp_path):
    from safetensors.torch import save_file

    model = _spiel_with_ages(5)
    model.save_pretrained(tmp_path, save_ages=True)
    path = tmp_path / "adapter_model.safetensors"
    tensors = load_file(path)
    key = "base_model.model.model.layers.0.self_attn.q_proj.sparse_ages"
    tensors[key] = tensors[key][:-1]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj: ages must be \d+ integers"):
        PeftModel.from_pretrained(tiny_llama(), tmp_path)
    tensors[key] = -torch.ones(tensors[key].numel() + 1, dtype=torch.int16)
    save_file(tensors, path)
    with pytest.raises(ValueError, match="q_proj: ages are optimizer steps and cannot be negative, found -1"):
        PeftModel.from_pretrained(tiny_llama(), tmp_path)


def test_the_scheduler_state_holds_the_ages_and_restores_them_over_an_adapter_loaded_without(tmp_path):
    """The plain-loop counterpart of a Trainer checkpoint: save_pretrained (no ages) + SpIELScheduler.save; the
    resumed model, loaded from the adapter (ages 0), takes its ages from the scheduler state."""
    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1, reselection_steps=3, gradient_estimation_steps=1))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = SpIELScheduler(model, optimizer, total_steps=10)
    model.train()
    for step in range(5):
        x = inputs(seed=step, batch=4)
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    ages = [l.sparse_ages["default"].clone() for l in sparse_layers(model)]
    assert any((a > 0).any() for a in ages)
    model.save_pretrained(tmp_path)
    scheduler.save(str(tmp_path))
    assert any(k.startswith("ages::") for k in load_file(tmp_path / "spiel_scheduler.safetensors"))
    resumed = PeftModel.from_pretrained(tiny_llama(), tmp_path, is_trainable=True)
    assert all(not l.sparse_ages["default"].any() for l in sparse_layers(resumed))
    opt2 = torch.optim.AdamW([p for p in resumed.parameters() if p.requires_grad], lr=1e-2)
    SpIELScheduler(resumed, opt2, total_steps=10).load(str(tmp_path))
    assert all(torch.equal(a, l.sparse_ages["default"]) for a, l in zip(ages, sparse_layers(resumed)))


# ------------------------------------------------------------------------------------------------ values dtype
def test_values_are_saved_in_the_dtype_asked_for_when_the_cast_is_exact(tmp_path):
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1))
    randomize_values(model)
    model.save_pretrained(tmp_path / "f64", values_dtype="float64")
    assert model.peft_config["default"].values_dtype == "float32"  # (the model's config is left as it was)
    tensors = load_file(tmp_path / "f64" / "adapter_model.safetensors")
    assert {t.dtype for k, t in tensors.items() if k.endswith("sparse_values")} == {torch.float64}
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "f64")
    assert loaded.peft_config["default"].values_dtype == "float64"
    for a, b in zip(sparse_layers(model), sparse_layers(loaded)):
        assert b.sparse_values["default"].dtype == torch.float64
        assert torch.equal(b.sparse_values["default"].detach(), a.sparse_values["default"].detach().double())
    # bfloat16 values saved as float32: exact
    bf16 = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1, values_dtype="bfloat16"))
    randomize_values(bf16)
    bf16.save_pretrained(tmp_path / "f32", values_dtype=torch.float32)
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "f32")
    for a, b in zip(sparse_layers(bf16), sparse_layers(loaded)):
        assert torch.equal(b.sparse_values["default"].detach(), a.sparse_values["default"].detach().float())


def test_a_lossy_cast_on_save_is_refused_unless_allowed(tmp_path):
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1))
    randomize_values(model)
    with pytest.raises(ValueError, match=r"save_pretrained\(values_dtype='bfloat16'\) would save the torch.float32 values of model.layers.0.self_attn.q_proj as torch.bfloat16.*allow_lossy_cast=True"):
        model.save_pretrained(tmp_path / "refused", values_dtype="bfloat16")
    assert not (tmp_path / "refused" / "adapter_model.safetensors").exists()
    assert model.peft_config["default"].values_dtype == "float32"
    model.save_pretrained(tmp_path / "bf16", values_dtype="bfloat16", allow_lossy_cast=True)
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "bf16")
    assert loaded.peft_config["default"].values_dtype == "bfloat16"
    for a, b in zip(sparse_layers(model), sparse_layers(loaded)):
        assert torch.equal(b.sparse_values["default"].detach(), a.sparse_values["default"].detach().bfloat16())
    # the config's values_dtype asks for it: refused the same way, naming the config field
    model.peft_config["default"].values_dtype = "float16"
    with pytest.raises(ValueError, match=r"the config's values_dtype='float16' \(adapter 'default'\) would save the torch.float32 values"):
        model.save_pretrained(tmp_path / "config")
    # float16 and bfloat16 cannot hold each other's values
    half = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1, values_dtype="float16"))
    with pytest.raises(ValueError, match="torch.float16 values .* as torch.bfloat16"):
        half.save_pretrained(tmp_path / "half", values_dtype="bfloat16")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"values_dtype": "int8"}, "save_pretrained: values_dtype='int8' is not supported; use one of float32, bfloat16, float16, float64"),
        ({"save_ages": "yes"}, "save_pretrained: save_ages must be True or False, got save_ages='yes'"),
        ({"allow_lossy_cast": 1}, "save_pretrained: allow_lossy_cast must be True or False, got allow_lossy_cast=1"),
    ],
)
def test_bad_save_arguments_are_refused_by_name(tmp_path, kwargs, match):
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1))
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        model.save_pretrained(tmp_path, **kwargs)


def test_other_peft_types_save_as_peft_saves_them(tmp_path):
    from peft import LoraConfig

    model = get_peft_model(tiny_llama(), LoraConfig(target_modules=["q_proj"], r=2))
    model.save_pretrained(tmp_path)
    assert sorted(load_file(tmp_path / "adapter_model.safetensors"))[0].endswith("lora_A.weight")
