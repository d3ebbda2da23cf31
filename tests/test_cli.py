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
    assert f"tunable weights: {total:,} in 14 modules = " in out
    targeted = sum(a * b for a, b in config["module_shapes"].values())
    assert f"= {total / targeted:.4%} of the targeted modules' {targeted:,} weights (the density)" in out
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


def _console_script(tmp_path):
    """The peft-sparse launcher an installer writes from pyproject's [project.scripts] (the same text pip writes)."""
    import os
    import sys
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        module, _, function = tomllib.load(f)["project"]["scripts"]["peft-sparse"].partition(":")
    script = tmp_path / "bin" / "peft-sparse"
    script.parent.mkdir(exist_ok=True)
    script.write_text(
        f"#!{sys.executable}\nimport re\nimport sys\nfrom {module} import {function}\nif __name__ == '__main__':\n"
        f"    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n    sys.exit({function}())\n"
    )
    return script, {**os.environ, "PYTHONPATH": root}


@pytest.mark.parametrize("argv,code", [(["--help"], 0), (["inspect", "--help"], 0), (["evaluate", "gsm"], 2), (["frobnicate"], 2)])
def test_help_and_argument_errors_import_neither_torch_nor_transformers(tmp_path, argv, code):
    import subprocess
    import sys

    script, env = _console_script(tmp_path)
    done = subprocess.run([sys.executable, "-X", "importtime", str(script), *argv], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == code, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "argparse" in imported  # (the listing is complete)
    assert not imported & {"torch", "transformers", "peft", "peft_sparse", "bitsandbytes"}
    assert ("usage: peft-sparse" in done.stdout) if code == 0 else ("usage: peft-sparse" in done.stderr)


def test_commands_that_do_not_quantize_print_no_optional_kernel_notice(tmp_path):
    """bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" (printed when PEFT imports it on a
    CPU with AVX-512 BF16 and the optional kernel cannot be fetched) stays out of a command that does not quantize;
    a 4-bit training command keeps it."""
    import subprocess
    import sys

    notice = "gemm_4bit_forward"
    control = subprocess.run([sys.executable, "-c", "import peft"], capture_output=True, text=True, timeout=300)
    if notice not in control.stderr:
        pytest.skip("bitsandbytes prints no optional-kernel notice on this machine (no AVX-512 BF16 CPU, or the kernel loads)")
    model = get_peft_model(tiny_llama(), SparseFTConfig(target_modules="all-linear", density=0.1))
    model.save_pretrained(tmp_path / "sft")
    script, env = _console_script(tmp_path)
    done = subprocess.run([sys.executable, str(script), "inspect", str(tmp_path / "sft")], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "method: SFT" in done.stdout, done.stderr[-2000:]
    assert notice not in done.stderr and "kernels-community" not in done.stderr
    recipe = tmp_path / "quantized.yaml"  # a 4-bit recipe that fails after the import: the notice is kept for it
    recipe.write_text("model: {source: " + str(tmp_path / "no-such-model") + ", quantization: nf4}\nmethod: {peft_type: SFT}\n")
    done = subprocess.run([sys.executable, str(script), "train", str(recipe)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0 and notice in done.stderr


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["inspect", "x"], False),
        (["train", "RECIPE"], True),
        (["train", "RECIPE", "--set", "model.quantization=null"], False),
        (["train", "PLAIN"], False),
        (["train", "PLAIN", "--set", "model.quantization=nf4"], True),
        (["train", "MISSING"], False),
    ],
)
def test_which_commands_quantize(tmp_path, argv, expected):
    from peft_sparse_cli import build_parser, quantizes

    (tmp_path / "q.yaml").write_text("model: {source: m, quantization: nf4}\n")
    (tmp_path / "p.yaml").write_text("model: {source: m}\n")
    paths = {"RECIPE": str(tmp_path / "q.yaml"), "PLAIN": str(tmp_path / "p.yaml"), "MISSING": str(tmp_path / "none.yaml")}
    assert quantizes(build_parser().parse_args([paths.get(a, a) for a in argv])) is expected
