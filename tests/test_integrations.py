"""The accelerate configs in integrations/ load with accelerate's own config reader (unknown keys are refused)
and say what integrations/README.md says they do."""

import re
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig

ROOT = Path(__file__).resolve().parent.parent / "integrations"


@pytest.mark.parametrize(
    "name, engine, check",
    [
        ("accelerate_ddp.yaml", "MULTI_GPU", lambda c: True),
        ("accelerate_fsdp2.yaml", "FSDP", lambda c: c.fsdp_config["fsdp_version"] == 2),
        ("accelerate_zero2.yaml", "DEEPSPEED", lambda c: c.deepspeed_config["zero_stage"] == 2),
        ("accelerate_zero3.yaml", "DEEPSPEED", lambda c: c.deepspeed_config["zero_stage"] == 3 and c.deepspeed_config["zero3_save_16bit_model"]),
    ],
)
def test_each_accelerate_config_loads_and_selects_its_engine(name, engine, check):
    config = ClusterConfig.from_yaml_file(str(ROOT / name))
    assert config.distributed_type.name == engine and check(config)
    assert f"--config_file integrations/{name}" in (ROOT / name).read_text() + (ROOT / "README.md").read_text()


def test_fsdp2_leaves_exactly_the_sparse_values_out_of_the_sharding():
    from peft import get_peft_model

    from peft_sparse import SpIELConfig
    from tests.models import tiny_llama

    pattern = ClusterConfig.from_yaml_file(str(ROOT / "accelerate_fsdp2.yaml")).fsdp_config["fsdp_ignored_modules"]
    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1))
    ignored = [n for n, _ in model.named_modules() if re.fullmatch(pattern, n)]
    assert ignored and all(n.endswith(".sparse_values") for n in ignored)
    assert len(ignored) == sum(1 for n, _ in model.named_modules() if n.endswith(".sparse_values"))
