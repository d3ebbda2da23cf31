"""Adapter files that don't fit the base model are refused with the module and the value named."""

import json
import os
import subprocess
import sys

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

from peft_sparse import SparseFTConfig

from .models import randomize_values, tiny_gpt2, tiny_llama

KEY = "base_model.model.model.layers.0.self_attn.q_proj.sparse_indices"
VKEY = "base_model.model.model.layers.0.self_attn.q_proj.sparse_values"


@pytest.fixture
def saved(tmp_path):
    # index lists (what these tests corrupt); density 0.1 would otherwise be stored as bitmaps
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules=["q_proj", "v_proj"], density=0.1, index_storage="list"))
    randomize_values(model)
    model.save_pretrained(tmp_path)
    return tmp_path


def _corrupt(path, edit):
    file = path / "adapter_model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def _load(path):
    return PeftModel.from_pretrained(tiny_llama(), path)


def test_index_out_of_range(saved):
    def edit(t):
        t[KEY][-1] = 32 * 32
    _corrupt(saved, edit)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj: index 1024 is outside the tensor of 1024"):
        _load(saved)


def test_unsorted_indices(saved):
    def edit(t):
        t[KEY][[0, 1]] = t[KEY][[1, 0]]
    _corrupt(saved, edit)
    with pytest.raises(ValueError, match="q_proj: indices must be sorted and unique, found unsorted"):
        _load(saved)


def test_duplicate_indices(saved):
    def edit(t):
        t[KEY][1] = t[KEY][0]
    _corrupt(saved, edit)
    with pytest.raises(ValueError, match="found duplicate indices"):
        _load(saved)


def test_wrong_index_dtype(saved):
    def edit(t):
        t[KEY] = t[KEY].long()
    _corrupt(saved, edit)
    with pytest.raises(ValueError, match="q_proj: indices have dtype torch.int64, expected torch.int32"):
        _load(saved)


def test_wrong_values_dtype(saved):
    def edit(t):
        t[VKEY] = t[VKEY].to(torch.bfloat16)
    _corrupt(saved, edit)
    with pytest.raises(ValueError, match="q_proj: values have dtype torch.bfloat16, expected torch.float32"):
        _load(saved)


def test_wrong_number_of_values(saved):
    def edit(t):
        t[KEY], t[VKEY] = t[KEY][:-1].contiguous(), t[VKEY][:-1].contiguous()
    _corrupt(saved, edit)
    with pytest.raises(ValueError, match="q_proj: the file holds 102 indices but the config expects 103"):
        _load(saved)


def test_missing_module_in_file(saved):
    def edit(t):
        del t[KEY], t[VKEY]
    _corrupt(saved, edit)
    with pytest.raises(ValueError, match="q_proj: the adapter file holds no indices/values"):
        _load(saved)


def test_adapter_of_another_model_shape(saved):
    config = json.loads((saved / "adapter_config.json").read_text())
    config["module_shapes"]["model.layers.0.self_attn.q_proj"] = [64, 32]
    (saved / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"q_proj: the adapter was made for a \(64, 32\) matrix but the model's is \(32, 32\)"):
        _load(saved)


def test_adapter_for_other_modules(saved):
    with pytest.raises(ValueError, match=r"not found in the base model"):
        PeftModel.from_pretrained(tiny_gpt2(), saved)
    deeper = tiny_llama()
    deeper.model.layers.append(type(deeper.model.layers[0])(deeper.config, layer_idx=2))
    with pytest.raises(ValueError, match=r"targeted but without a count: \['model.layers.2.self_attn.q_proj'"):
        PeftModel.from_pretrained(deeper, saved)


def test_loading_without_import_gives_peft_error(saved):
    code = (
        "from peft import PeftModel\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "m = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,"
        " num_attention_heads=4, num_key_value_heads=2))\n"
        f"PeftModel.from_pretrained(m, {str(saved)!r})\n"
    )
    # with the auto-registration switched off (test_autoload.py covers it switched on)
    env = {**os.environ, "PEFT_SPARSE_AUTOLOAD": "0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode != 0
    assert "KeyError: 'SFT'" in result.stderr


@pytest.mark.parametrize("method", ["sft", "spiel", "spiel-block"])
def test_transformers_adapter_loading_gives_the_peft_model(tmp_path, method):
    """transformers' own adapter loading — ``model.load_adapter(dir)`` and ``AutoModelForCausalLM.from_pretrained``
    of an adapter directory — loads the sparse adapter (PEFT's key prefix of both methods is the layers'
    ``sparse_``): the same logits as ``PeftModel.from_pretrained``, different from the base model's."""
    from transformers import AutoModelForCausalLM

    from peft_sparse import SpIELConfig

    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    tiny_llama().save_pretrained(base_dir)
    config = (
        SparseFTConfig(target_modules="all-linear", density=0.25) if method == "sft"
        else SpIELConfig(target_modules="all-linear", density=0.25, block_shape=(4, 4) if method == "spiel-block" else (1, 1))
    )  # fmt: skip
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
    randomize_values(model, scale=0.1)
    model.save_pretrained(adapter_dir)
    x = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = PeftModel.from_pretrained(tiny_llama(), adapter_dir).eval()(x).logits
        bare = tiny_llama()(x).logits
        hosted = tiny_llama()
        hosted.load_adapter(str(adapter_dir))
        direct = AutoModelForCausalLM.from_pretrained(adapter_dir).eval()
        for got in (hosted.eval()(x).logits, direct(x).logits):
            assert torch.equal(got, want) and not torch.equal(got, bare)


def test_transformers_adapter_loading_checks_the_file(saved):
    """An adapter file loaded by transformers' own loader (which does not go through PEFT's checks) is
    checked at its first pass, with the module and the value named, as PEFT's loading checks it."""

    def edit(t):
        t[KEY][[0, 1]] = t[KEY][[1, 0]]

    _corrupt(saved, edit)
    model = tiny_llama()
    model.load_adapter(str(saved))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj: indices must be sorted and unique, found unsorted"):
        model(torch.zeros(1, 3, dtype=torch.long))


def _counts_and_shapes(model):
    config = model.peft_config["default"]
    return [(name, count, config.module_shapes[name]) for name, count in config.tunable_weights_per_module.items()]


@pytest.mark.parametrize("density", [0.01, 0.1, 0.6])
def test_list_bitmap_and_elias_fano_storage_give_identical_models(tmp_path, density):
    """index_storage: 'list', 'bitmap', 'elias-fano' and 'auto' files load into the same model; 'auto' is the
    smallest file (Elias–Fano below density 1/4 on these tensors, the bitmap above); merge_sparse_adapters and
    inspect read every form."""
    from peft_sparse.core.compose import adapter_file_summary, merge_sparse_adapters
    from peft_sparse.core.storage import choose

    x = torch.randint(0, 97, (2, 7))
    forms = {"list": "sparse_indices", "bitmap": "sparse_index_bits", "elias-fano": "sparse_index_upper"}
    sizes, logits, merged = {}, {}, {}
    for storage in (*forms, "auto"):
        model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=density, index_storage=storage))
        randomize_values(model)
        model.save_pretrained(tmp_path / storage)
        keys = load_file(tmp_path / storage / "adapter_model.safetensors")
        chosen = {  # (per tensor: each form's exact size, its header included)
            name: storage if storage != "auto" else choose(count, shape[0] * shape[1], 4, "auto")
            for name, count, shape in _counts_and_shapes(model)
        }
        assert {k.removeprefix("base_model.model.").rsplit(".", 1)[0]: k.rsplit(".", 1)[1] for k in keys if not k.endswith("sparse_values")} == {
            name: forms[form] for name, form in chosen.items()
        }
        sizes[storage] = {}  # bytes of each tensor's positions
        for k, t in keys.items():
            if not k.endswith("sparse_values"):
                name = k.removeprefix("base_model.model.").rsplit(".", 1)[0]
                sizes[storage][name] = sizes[storage].get(name, 0) + t.numel() * t.element_size()
        logits[storage] = _load(tmp_path / storage)(x).logits
        merged[storage] = merge_sparse_adapters(tiny_llama(), [tmp_path / storage])(x).logits
        summary = adapter_file_summary(tmp_path / storage)
        assert summary["num_tunable_weights"] == sum(model.peft_config["default"].tunable_weights_per_module.values())
        assert {name: m["index_storage"] for name, m in summary["modules"].items()} == chosen
    if density == 0.1:  # (the tiny tensors' choice: Elias–Fano for every one at this density)
        assert set(chosen.values()) == {"elias-fano"}
    for storage in ("bitmap", "elias-fano", "auto"):
        assert torch.equal(logits["list"], logits[storage]) and torch.equal(merged["list"], merged[storage])
    torch.testing.assert_close(merged["list"], logits["list"], rtol=1e-5, atol=1e-5)
    assert sizes["auto"] == {name: min(sizes[form][name] for form in forms) for name in sizes["auto"]}
    with pytest.raises(ValueError, match="index_storage must be 'auto', 'list', 'bitmap' or 'elias-fano', got index_storage='dense'"):
        SparseFTConfig(target_modules="all-linear", density=0.1, index_storage="dense")


def _damage_header(path):
    """Keep the header's length, replace its JSON with bytes that are not JSON ("invalid JSON in header")."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    path.write_bytes(data[:8] + b"x" * length + data[8 + length :])


def test_a_damaged_weights_file_is_named_wherever_an_adapter_is_read(tmp_path, capsys, monkeypatch):
    from peft_sparse import BottleneckConfig, MADGConfig, load_sparse_adapter, merge_sparse_adapters
    from peft_sparse.cli import main
    from peft_sparse.transfer import add_frozen_adapter

    sparse = tmp_path / "sparse"
    get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1)).save_pretrained(sparse)
    bottleneck = tmp_path / "bottleneck"
    get_peft_model(tiny_llama(), BottleneckConfig(bottleneck_size=4)).save_pretrained(bottleneck)
    generator = tmp_path / "generator"
    get_peft_model(tiny_llama(), MADGConfig(languages=["deu", "eng"], bottleneck_size=4)).save_pretrained(generator)
    for directory in (sparse, bottleneck, generator):
        _damage_header(directory / "adapter_model.safetensors")

    def refused(call, directory):
        with pytest.raises(ValueError) as info:
            call()
        text = str(info.value)
        assert str(directory / "adapter_model.safetensors") in text and "invalid JSON in header" in text and "damaged" in text

    refused(lambda: PeftModel.from_pretrained(tiny_llama(), sparse), sparse)
    refused(lambda: load_sparse_adapter(tiny_llama(), sparse), sparse)
    refused(lambda: merge_sparse_adapters(tiny_llama(), [sparse]), sparse)
    refused(lambda: PeftModel.from_pretrained(tiny_llama(), bottleneck), bottleneck)
    stack_on = get_peft_model(tiny_llama(), BottleneckConfig(bottleneck_size=4), adapter_name="task")
    refused(lambda: add_frozen_adapter(stack_on, bottleneck, "lang"), bottleneck)
    # the command: one line naming the file, for every kind of adapter and every command that reads one
    monkeypatch.setattr("peft_sparse.assets.load_model_and_tokenizer", lambda *a, **k: (tiny_llama(), None))
    commands = [["inspect", str(sparse)], ["inspect", str(bottleneck)], ["inspect", str(generator)],
                ["merge", "--base", "x", "--adapter", str(sparse), "--output", str(tmp_path / "merged")],
                ["evaluate", "gsm", "--base", "x", "--adapter", str(sparse), "--data", str(tmp_path / "none.jsonl")]]  # fmt: skip
    for argv in commands:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        directory = argv[-1] if argv[0] == "inspect" else str(sparse)
        assert err.count("\n") == 0 and os.path.join(directory, "adapter_model.safetensors") in err and "invalid JSON" in err, (argv, err)
    # a damaged config is named too
    (sparse / "adapter_config.json").write_text('{"peft_type": "SFT", ')
    with pytest.raises(ValueError, match="adapter_config.json is damaged or incomplete: it is not valid JSON"):
        load_sparse_adapter(tiny_llama(), sparse)
    assert main(["inspect", str(sparse)]) == 2 and "adapter_config.json is damaged" in capsys.readouterr().err
