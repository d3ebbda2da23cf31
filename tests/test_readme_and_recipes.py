"""The README's set-up commands, the CI entry point and every YAML recipe stay consistent (the code blocks of the README
and the documentation site: tests/test_docs.py)."""

import re
from pathlib import Path

import pytest
import yaml

from peft_sparse.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set-up: two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, re.S)


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
    commands = _readme_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    main_job, tests = commands
    assert "peft-sparse train recipes/" in main_job and "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci
    assert f"{tests} && mkdocs build --strict" in ci  # the site builds in CI, broken links failing it
    assert "docs" in re.search(r'"\.\[([\w,]+)\]"', tests).group(1).split(",")  # (mkdocs comes with the docs extra)
    recipe = main_job.split("peft-sparse train ", 1)[1].split()[0]
    assert (ROOT / recipe).is_file()


def test_recipes_are_found():
    assert RECIPES, "no recipe found: the validation below would pass vacuously"


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_builds_what_it_names(path):
    import torch

    # the GPU recipes ask for bf16, which TrainingArguments refuses to build on a machine without a GPU
    gpu_only = yaml.safe_load(path.read_text())["training"].get("bf16") and not torch.cuda.is_available()
    recipe = load_recipe(path, overrides={"training.bf16": False} if gpu_only else None)
    assert recipe.peft_config is None or recipe.peft_config.peft_type is not None  # (None: full fine-tuning)
    train = recipe.data["train"]
    assert (isinstance(train, str) and train.startswith("hub:")) or train.is_file()
    assert recipe.training_args.output_dir


def test_instruction_recipes_are_the_generator_output_at_the_thesis_settings(tmp_path):
    """recipes/instruction/*.yaml are exactly what make_recipes.py writes (no hand edits drift), one per method ×
    dataset, with Table 7.1's learning rates and λ and LoRA r = 64's trainable count for SpIEL."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_recipes", ROOT / "recipes" / "instruction" / "make_recipes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--out", str(tmp_path)])
    written = sorted(p.name for p in tmp_path.glob("*.yaml"))
    assert len(written) == 7 * 3 and written == sorted(p.name for p in (ROOT / "recipes" / "instruction").glob("*.yaml"))
    for name in written:
        assert (tmp_path / name).read_text() == (ROOT / "recipes" / "instruction" / name).read_text(), name
    cpu = {"training.bf16": False}
    ag = load_recipe(ROOT / "recipes/instruction/spiel_ag-flan_v2.yaml", overrides=cpu)
    ma = load_recipe(ROOT / "recipes/instruction/qspiel_ma-tulu_v2.yaml", overrides=cpu)
    assert (ag.training_args.learning_rate, ag.training_args.weight_decay, ag.peft_config.growth) == (1e-4, 30.0, "ag")
    assert (ma.training_args.learning_rate, ma.training_args.weight_decay, ma.model["quantization"]) == (1e-3, 0.3, "nf4")
    assert ma.sm3 and not ag.sm3  # (MA with SM3, the thesis's pairing, named in the recipe)
    # LoRA r = 64 on all 7 projections of Llama-2-7B: r·(in + out) summed over the 32 blocks
    per_block = 4 * 64 * (4096 + 4096) + 3 * 64 * (4096 + 11008)
    assert ag.peft_config.num_tunable_weights == 32 * per_block
    lora = load_recipe(ROOT / "recipes/instruction/lora-gpt4_alpaca.yaml", overrides=cpu).peft_config
    assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (64, 16, 0.1)
    assert ag.training_args.num_train_epochs == 2 and ag.training_args.per_device_train_batch_size * ag.training_args.gradient_accumulation_steps == 128


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"modle": {}}, r"unknown keys \['modle'\]"),
        ({"method": {"peft_type": "IA3"}}, r"method.peft_type='IA3' is not supported; choose one of .*, LORA or FULL"),
        ({"method": {"peft_type": "FULL", "r": 8}}, r"peft_type=FULL \(full fine-tuning\) takes no other fields, got \['r'\]"),
        ({"model": {"source": "x", "quantization": "int3"}}, r"model.quantization='int3' is not supported"),
        ({"data": {"train_limit": 0}}, r"data.train_limit must be a positive integer"),
        ({"method": {"peft_type": "SFT", "density": 0.1, "rank": 8}}, r"fields \['rank'\] that SparseFTConfig"),
        ({"training": {"learning_rat": 1.0}}, r"fields \['learning_rat'\] that trl.SFTConfig"),
        ({"data": {"train": "nope.jsonl"}}, r"data.train='nope.jsonl' does not exist"),
        ({"method": {"peft_type": "SFT", "density": 2.0}}, "density must be in"),
        ({"training": {"max_steps": "abc"}}, r"training.max_steps='abc' must be int"),
        ({"training": {"learning_rate": "fast"}}, r"training.learning_rate='fast' must be float"),
        ({"training": {"packing": "yes"}}, r"training.packing='yes' must be bool"),
        ({"training": {"max_length": 1.5}}, r"training.max_length=1.5 must be"),
        ({"method": 5}, r"section 'method' must be a mapping of keys to values, got method=5"),
        ({"slow_fast": {"c1": -1}, "training": {"use_cpu": True, "bf16": False}}, r"recipe slow_fast: c1 must be a positive number, got c1=-1"),
        ({"evaluation": {"reference": ["a"]}}, r"evaluation.reference must map labels to text, got evaluation.reference=\['a'\]"),
        ({"evaluation": {"sharded": "gather"}}, r"evaluation.sharded must be one of \('reload', 'skip'\), got evaluation.sharded='gather'"),
        ({"training": {"weight_decay": "auto"}}, r"training.weight_decay='auto' .* needs training.max_steps > 0, got training.max_steps=-1"),
        ({"training": {"weight_decay": "auto", "max_steps": 10, "learning_rate": 0.0}}, r"training.learning_rate=0.0.*positive finite"),
        ({"training": {"weight_decay": "lots"}}, r"training.weight_decay must be a number or 'auto', got training.weight_decay='lots'"),
        ({"method": {"peft_type": "SPIEL", "growth": "ma", "density": 0.1, "target_modules": "all-linear"},
          "training": {"optim": "sm3", "optim_args": "momentum=0.9,betas=0.99", "use_cpu": True, "bf16": False}}, r"optim_args='momentum=0.9,betas=0.99'.*takes momentum=, beta2= and eps=, got 'betas=0.99'"),
        ({"method": {"peft_type": "SPIEL", "growth": "ma", "density": 0.1, "target_modules": "all-linear"},
          "training": {"optim": "sm3", "optim_args": "beta2=1.0", "use_cpu": True, "bf16": False}}, r"optim_args='beta2=1.0' for SpIEL-MA's SM3: SM3: beta2 must be None .* got beta2=1.0"),
        ({"method": {"peft_type": "SPIEL", "growth": "ma", "density": 0.1, "target_modules": "all-linear"},
          "training": {"optim": "sm3", "optim_args": "momentum=fast", "use_cpu": True, "bf16": False}}, r"momentum must be a number, got 'fast'"),
        ({"method": {"peft_type": "SPIEL", "growth": "ma", "density": 0.1, "target_modules": "all-linear"},
          "training": {"optim_args": "momentum=0.9", "use_cpu": True, "bf16": False}},
         r"training.optim_args='momentum=0.9' would be ignored: AdamW \(training.optim=None\) reads no optim_args; .*training.optim: sm3"),
        ({"method": {"peft_type": "LT_SFT", "density": 0.01, "dense_steps": 10, "sparse_steps": 10},
          "training": {"max_steps": 60, "use_cpu": True, "bf16": False}},
         r"training.max_steps=60 must equal method.dense_steps \+ method.sparse_steps = 10 \+ 10"),
    ],
)
def test_bad_recipes_name_the_field(bad, message, tmp_path):
    base = {
        "model": {"source": "smollm2-135m-instruct"},
        "method": {"peft_type": "SFT", "density": 0.1, "target_modules": "all-linear"},
        "data": {"train": str(ROOT / "recipes/data/skills_train.jsonl")},
        "training": {"output_dir": str(tmp_path)},
    }
    for section, value in bad.items():
        base[section] = {**base.get(section, {}), **value} if section in base and section != "method" else value
    with pytest.raises(ValueError, match=message):
        load_recipe(base)


def test_weight_decay_auto_follows_the_run_length():
    """training.weight_decay: auto is λ = min(3, 1/(lr·T)): 3 at the main recipe's 60 steps, 1/(lr·T) past
    T = 1/(3·lr) (333 steps at lr 1e-3); a CLI override of max_steps moves it; a number stays as given."""
    from peft_sparse.schedules.weight_decay import auto_weight_decay

    assert auto_weight_decay(1e-3, 60) == 3.0 and auto_weight_decay(1e-3, 150) == 3.0
    assert auto_weight_decay(1e-3, 600) == pytest.approx(1 / 0.6) and auto_weight_decay(1e-3, 1000) == pytest.approx(1.0)
    assert auto_weight_decay(2e-4, 1000) == 3.0 and auto_weight_decay(1e-3, 334) < 3.0 <= auto_weight_decay(1e-3, 333)
    for bad in ((1e-3, 0), (1e-3, 10.0), (-1e-3, 10), (float("nan"), 10), (True, 10)):
        with pytest.raises(ValueError, match="weight_decay='auto'"):
            auto_weight_decay(*bad)
    main = ROOT / "recipes/smollm2_spiel.yaml"
    assert load_recipe(main).training_args.weight_decay == 3.0
    assert load_recipe(main, overrides={"training.max_steps": 1000}).training_args.weight_decay == pytest.approx(1.0)
    long = load_recipe(main, overrides={"training.max_steps": 600, "training.learning_rate": 5e-4})
    assert long.training_args.weight_decay == 3.0  # (1/(5e-4·600) = 3.33, capped)
    assert load_recipe(main, overrides={"training.max_steps": 1000, "training.weight_decay": 0.5}).training_args.weight_decay == 0.5


def test_recipe_file_that_is_not_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model: {source: smollm2-135m-instruct\n")
    with pytest.raises(ValueError, match=r"broken.yaml is not valid YAML"):
        load_recipe(path)


def test_bundled_data_is_disjoint_and_well_formed():
    import json

    rows = {split: [json.loads(l) for l in open(ROOT / f"recipes/data/skills_{split}.jsonl")] for split in ("train", "test")}
    assert len(rows["train"]) >= 300 and len(rows["test"]) >= 50
    prompts = {s: {r["prompt"][0]["content"] for r in rs} for s, rs in rows.items()}
    assert not prompts["train"] & prompts["test"]
    for r in rows["test"]:
        assert r["completion"][0]["content"] == r["answer"]


def test_recipes_build_their_training_arguments_without_deprecation_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        recipe = load_recipe(ROOT / "recipes/instruction/spiel_ag-tulu_v2.yaml", overrides={"training.bf16": False})
    assert recipe.training_args.activation_checkpointing is True  # TRL's default (not set there), under the current name
    small = load_recipe(ROOT / "recipes/smollm2_spiel.yaml")  # (sets gradient_checkpointing: false)
    assert small.training_args.activation_checkpointing is False
    on = load_recipe(ROOT / "recipes/smollm2_spiel.yaml", overrides={"training.gradient_checkpointing": True})
    assert on.training_args.activation_checkpointing is True


def test_trainer_weight_decay_reaches_every_sparse_value():
    """The docs tell SpIEL-AG users to set weight_decay: Trainer's decay list must hold every sparse value."""
    from peft import get_peft_model
    from transformers import Trainer, TrainingArguments

    from peft_sparse import SpIELConfig

    from .models import tiny_llama

    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.05))
    values = {n for n, p in model.named_parameters() if p.requires_grad}
    assert values and all("sparse" in n or "values" in n for n in values)
    args = TrainingArguments(output_dir="unused", weight_decay=3.0, report_to="none", use_cpu=True)
    decayed = set(Trainer(model=model, args=args).get_decay_parameter_names(model))
    assert values <= decayed


def test_the_main_recipe_trains_on_several_processes_as_the_multi_gpu_guide_launches_it(monkeypatch):
    """docs/multi-gpu.md launches recipes/smollm2_spiel.yaml under DDP, FSDP2 and DeepSpeed: its method must be one
    the scheduler takes on several processes (the adaptive split, which resizes the values, is refused there)."""
    import dataclasses

    import torch
    from peft import get_peft_model

    from peft_sparse import SpIELScheduler
    from peft_sparse.methods.spiel import scheduler as spiel_scheduler

    from .models import tiny_llama

    method = load_recipe(ROOT / "recipes/smollm2_spiel.yaml").peft_config
    assert method.budget_split == "uniform"
    monkeypatch.setattr(spiel_scheduler, "distributed", lambda: True)  # (as under torchrun with 2 processes)
    monkeypatch.setattr(spiel_scheduler.SpIELScheduler, "_check_ranks_agree", lambda self: None)
    for split, refused in (("uniform", False), ("adaptive", True)):
        config = dataclasses.replace(method, num_tunable_weights=None, density=0.1, budget_split=split)
        model = get_peft_model(tiny_llama(), config)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        if refused:
            with pytest.raises(ValueError, match="budget_split='adaptive'"):
                SpIELScheduler(model, optimizer, total_steps=60)
        else:
            SpIELScheduler(model, optimizer, total_steps=60)
