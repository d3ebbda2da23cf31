"""Sparse adapters load through PEFT without `import peft_sparse`: the peft_sparse_autoload.pth hook."""

import os
import site
import subprocess
import sys
import textwrap

import pytest
from peft import get_peft_model

from peft_sparse import SpIELConfig

from .models import inputs, randomize_values, tiny_llama

INSTALLED = any(os.path.isfile(os.path.join(d, "peft_sparse_autoload.pth")) for d in [*site.getsitepackages(), site.getusersitepackages()])


def _run(code: str, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "PEFT_SPARSE_AUTOLOAD"} | env
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=environment, cwd="/")


@pytest.mark.skipif(not INSTALLED, reason="the package was installed without its .pth file (pip install -e . installs it)")
def test_peft_alone_loads_a_sparse_adapter_and_the_switch_turns_it_off(tmp_path):
    base = tiny_llama()
    base.save_pretrained(tmp_path / "base")
    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1))
    randomize_values(model)
    model.peft_config["default"].base_model_name_or_path = str(tmp_path / "base")
    model.save_pretrained(tmp_path / "adapter")
    expected = model(inputs()).logits
    code = f"""
        import sys, torch
        from peft import AutoPeftModelForCausalLM
        model = AutoPeftModelForCausalLM.from_pretrained({str(tmp_path / "adapter")!r})
        x = torch.load({str(tmp_path / "x.pt")!r})
        torch.save(model(x).logits, {str(tmp_path / "y.pt")!r})
        print(type(model.peft_config["default"]).__name__)
    """
    import torch

    torch.save(inputs(), tmp_path / "x.pt")
    done = _run(code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("SpIELConfig")
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), expected)
    off = _run(code, PEFT_SPARSE_AUTOLOAD="0")
    assert off.returncode != 0 and "SPIEL" in off.stderr


@pytest.mark.skipif(not INSTALLED, reason="the package was installed without its .pth file")
def test_interpreter_start_does_not_import_torch_or_peft():
    done = _run("import sys; print(sorted(m for m in ('torch', 'peft', 'peft_sparse', 'peft_sparse_autoload') if m in sys.modules))")
    assert done.stdout.strip() == "['peft_sparse_autoload']"
