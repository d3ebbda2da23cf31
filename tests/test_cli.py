"""The peft-sparse command on tiny adapters (the real-model run of train/merge is in the slow tier)."""

import json

import pytest
import torch
from peft import get_peft_model

from peft_sparse import SparseFTConfig, SpIELConfig
from peft_sparse.cli import main

from .models import randomize_values, sparse_layers, tiny_llama


@pytest.fixture
def spiel_dir(tmp_path):
    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1))
    randomize_values(model)
    for i, layer in enumerate(sparse_layers(model)):
        layer.sparse_ages["default"].copy_(torch.arange(layer.sparse_ages["default"].numel(), dtype=torch.int32) % (i + 2))
    model.save_pretrained(tmp_path / "spiel", save_ages=True)
    return tmp_path / "spiel"


def test_inspect_reports_method_counts_density_and_size(spiel_dir, capsys):
    assert main(["inspect", str(spiel_dir)]) == 0
    out = capsys.readouterr().out
    config = json.loads((spiel_dir / "adapter_config.json").read_text())
    total = sum(config["tunable_weights_per_module"].values())
    assert "method: SPIEL" in out
    assert f"tunable weights: {total:,} in 14 modules" in out
    assert "model.layers.1.mlp.down_proj" in out and "10.0000%" in out
    size = (spiel_dir / "adapter_model.safetensors").stat().st_size
    assert f"{size:,} bytes" in out
    assert main(["inspect", str(spiel_dir), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_tunable_weights"] == total and summary["file_bytes"] == size
    assert summary["modules"]["model.layers.0.self_attn.q_proj"]["density"] == pytest.approx(0.1, abs=0.002)


def test_inspect_writes_the_age_histogram(spiel_dir, tmp_path):
    png = tmp_path / "ages.png"
    assert main(["inspect", str(spiel_dir), "--age-histogram", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000


def test_inspect_reads_the_ages_of_a_checkpoint_folder_from_the_scheduler_state(tmp_path):
    """A Trainer checkpoint's adapter holds no ages; the SpIEL scheduler's state beside it does."""
    from peft_sparse import SpIELScheduler

    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1))
    for layer in sparse_layers(model):
        layer.sparse_ages["default"].copy_(torch.arange(layer.sparse_ages["default"].numel(), dtype=torch.int32) % 5)
    model.save_pretrained(tmp_path / "checkpoint")
    SpIELScheduler(model, torch.optim.AdamW(model.parameters()), total_steps=10).save(str(tmp_path / "checkpoint"))
    png = tmp_path / "ages.png"
    assert main(["inspect", str(tmp_path / "checkpoint"), "--age-histogram", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_errors_are_clear(tmp_path, capsys):
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1))
    model.save_pretrained(tmp_path / "sft")
    assert main(["inspect", str(tmp_path / "sft"), "--age-histogram", str(tmp_path / "x.png")]) == 2
    assert "holds no per-index ages" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    assert "holds no adapter_config.json" in capsys.readouterr().err


def test_help_texts_are_plain_text(capsys):
    from peft_sparse.cli import build_parser

    parser = build_parser()
    texts = [parser.format_help()] + [p.format_help() for p in parser._subparsers._group_actions[0].choices.values()]
    assert all("``" not in t for t in texts)


def test_a_missing_optional_extra_is_one_line_naming_it(spiel_dir, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    assert main(["inspect", str(spiel_dir), "--age-histogram", str(tmp_path / "a.png")]) == 3
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "peft-sparse[plot]" in err


def test_merge_writes_under_outputs_by_default(monkeypatch, tmp_path):
    from peft_sparse import cli

    seen = {}

    class _Model:
        def save_pretrained(self, path):
            seen["path"] = path

    monkeypatch.setattr("peft_sparse.assets.load_model_and_tokenizer", lambda *a, **k: (_Model(), _Model()))
    monkeypatch.setattr("peft_sparse.core.compose.merge_sparse_adapters", lambda *a, **k: None)
    assert cli.main(["merge", "--base", "x", "--adapter", str(tmp_path / "my-adapter")]) == 0
    assert seen["path"].replace("\\", "/") == "outputs/merged-my-adapter"
