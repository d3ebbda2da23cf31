"""MAD-G: bottleneck adapters (BOTTLENECK), the typology-conditioned generator (MADG), stacking, generation for
unseen languages, the language sampler and routing, and the bad-input errors."""

import json
import math
import os

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import Trainer, TrainingArguments, XLMRobertaConfig, XLMRobertaForMaskedLM

from peft_sparse import BottleneckConfig, MADGConfig, generate_language_adapter
from peft_sparse.cli import main as cli
from peft_sparse.core.blocks import find_ffn_outputs
from peft_sparse.data import LanguageBatchStream, LanguageCollator, LanguageSampler
from peft_sparse.methods.madg import feature_names, uriel_vector
from peft_sparse.methods.madg.generator import MADGLayer, madg_layers
from peft_sparse.transfer import LanguageSwitch, add_frozen_adapter, stack

from .models import inputs, tiny_bert, tiny_gpt2, tiny_llama


def tiny_xlmr():
    torch.manual_seed(0)
    config = XLMRobertaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                              max_position_embeddings=70, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    return XLMRobertaForMaskedLM(config).eval()


BUILDERS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "bert": tiny_bert, "xlmr": tiny_xlmr}
FFN = {
    "llama": ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"],
    "gpt2": ["transformer.h.0.mlp.c_proj", "transformer.h.1.mlp.c_proj"],
    "bert": ["bert.encoder.layer.0.output.dense", "bert.encoder.layer.1.output.dense"],
    "xlmr": ["roberta.encoder.layer.0.output.dense", "roberta.encoder.layer.1.output.dense"],
}


def out(model, x, **kw):
    return model(x, **kw).logits


def module_output(base, name, x):
    """The output of module ``name`` of ``base`` on input ``x`` (a forward hook)."""
    seen = {}
    handle = base.get_submodule(name).register_forward_hook(lambda m, a, o: seen.setdefault("y", o))
    base(x)
    handle.remove()
    return seen["y"]


# ---------------------------------------------------------------------------------------------- typology
def test_uriel_vectors_are_lang2vec_syntax_phonology_inventory():
    from peft_sparse.methods.madg.typology import _lang2vec

    l2v = _lang2vec()
    names = feature_names()
    assert len(names) == 289 and names[0] == "S_SVO" and names[103].startswith("P_") and names[131].startswith("INV_")
    t = uriel_vector("deu")
    expected = l2v.get_features(["deu"], "syntax_knn+phonology_knn+inventory_knn")["deu"]
    assert t.shape == (289,) and t.tolist() == [float(v) for v in expected]
    assert not torch.equal(t, uriel_vector("jpn"))


def test_unknown_code_and_bad_vectors_are_refused():
    with pytest.raises(ValueError, match=r"'deo' is not in the URIEL database; close codes in URIEL: \['de"):
        uriel_vector("deo")
    with pytest.raises(ValueError, match="not an ISO 639-3 code"):
        uriel_vector("German")
    with pytest.raises(ValueError, match=r"typology vector of 'xx1' has 3 entries; MAD-G needs 289"):
        MADGConfig(languages=["xx1"], typology_vectors={"xx1": [0.0, 1.0, 0.0]})
    with pytest.raises(ValueError, match="'qqq' is not in the URIEL database"):
        MADGConfig(languages=["deu", "qqq"])
    for field in ("bottleneck_size", "language_embedding_dim", "layer_embedding_dim"):
        with pytest.raises(ValueError, match=f"{field} must be a positive integer, got {field}=0"):
            MADGConfig(languages=["deu"], **{field: 0})
    with pytest.raises(ValueError, match=r"bottleneck_size must be a positive integer, got bottleneck_size=-4"):
        BottleneckConfig(bottleneck_size=-4)
    with pytest.raises(ValueError, match="languages must be a non-empty list"):
        MADGConfig(languages=[])


# ---------------------------------------------------------------------------------------------- bottleneck
@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_ffn_outputs_found_from_the_model(arch):
    assert find_ffn_outputs(BUILDERS[arch]()) == FFN[arch]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_bottleneck_forward_is_y_plus_up_relu_down(arch):
    x = inputs()
    base = BUILDERS[arch]()
    model = get_peft_model(BUILDERS[arch](), BottleneckConfig(bottleneck_size=8, init_weights=False))
    layer = model.get_base_model().get_submodule(FFN[arch][0])
    down, up = layer.bottleneck_down["default"], layer.bottleneck_up["default"]
    with torch.no_grad():
        down.bias.normal_()
        up.bias.normal_()
    y = module_output(base, FFN[arch][0], x)
    expected = y + torch.relu(y @ down.weight.T + down.bias) @ up.weight.T + up.bias
    torch.testing.assert_close(module_output(model.get_base_model(), FFN[arch][0], x), expected)
    with model.disable_adapter():
        torch.testing.assert_close(out(model, x), out(base, x))
    identity = get_peft_model(BUILDERS[arch](), BottleneckConfig(bottleneck_size=8))  # U = 0: the identity
    torch.testing.assert_close(out(identity, x), out(base, x))


def test_bottleneck_save_load_unload_and_no_merge(tmp_path):
    x = inputs()
    model = get_peft_model(tiny_llama(), BottleneckConfig(bottleneck_size=8, init_weights=False))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("bottleneck_" in n for n in trainable)
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    assert torch.equal(out(loaded, x), out(model, x))
    with pytest.raises(ValueError, match="non-linear and cannot be merged"):
        model.merge_and_unload()
    base = model.unload()
    torch.testing.assert_close(out(base, x), out(tiny_llama(), x))


def test_inspect_summarises_a_bottleneck_adapter(tmp_path, capsys):
    model = get_peft_model(tiny_llama(), BottleneckConfig(bottleneck_size=8))
    model.save_pretrained(tmp_path)
    assert cli(["inspect", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    per_module = 2 * 32 * 8 + 8 + 32  # D, U and their biases
    assert info["modules"] == {name: per_module for name in FFN["llama"]} and info["parameters"] == 2 * per_module
    assert cli(["inspect", str(tmp_path), "--feature-plot", str(tmp_path / "x.png")]) == 2  # a MAD-G-only option


def test_stack_is_language_then_task_and_only_task_trains(tmp_path):
    x = inputs()
    lang = get_peft_model(tiny_llama(), BottleneckConfig(bottleneck_size=8, init_weights=False), adapter_name="lang")
    lang.save_pretrained(tmp_path / "la")
    model = get_peft_model(tiny_llama(), BottleneckConfig(bottleneck_size=4, init_weights=False), adapter_name="task")
    add_frozen_adapter(model, tmp_path / "la" / "lang", "lang")  # PEFT saves a non-default adapter in a sub-folder
    stack(model, ["lang"], "task")
    # sequential modules by hand: y → language adapter → task adapter
    layer = model.get_base_model().get_submodule(FFN["llama"][1])
    y = module_output(tiny_llama(), FFN["llama"][1], x)

    def apply(z, name):
        d, u = layer.bottleneck_down[name], layer.bottleneck_up[name]
        return z + torch.relu(z @ d.weight.T + d.bias) @ u.weight.T + u.bias

    base_out = module_output(model.get_base_model(), FFN["llama"][1], x)
    assert not torch.allclose(apply(apply(y, "task"), "lang"), apply(apply(y, "lang"), "task"))  # the order matters
    out(model, x).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "bottleneck_" in n}
    assert all(g is not None for n, g in grads.items() if ".task" in n)
    assert all(g is None for n, g in grads.items() if ".lang" in n)
    # the first block's output feeds the second, so compare the second block given the stacked first block
    seen = {}
    h = (
        model.get_base_model()
        .get_submodule(FFN["llama"][1])
        .base_layer.register_forward_hook(lambda m, a, o: seen.setdefault("y", o))
    )
    model(x)
    h.remove()
    torch.testing.assert_close(base_out, apply(apply(seen["y"], "lang"), "task"))


def test_stacking_an_adapter_of_another_base_model_is_refused(tmp_path):
    other = get_peft_model(tiny_llama(hidden_size=48, intermediate_size=64), BottleneckConfig(bottleneck_size=4))
    other.save_pretrained(tmp_path / "wide")
    model = get_peft_model(tiny_llama(), BottleneckConfig(bottleneck_size=4), adapter_name="task")
    with pytest.raises(
        ValueError,
        match=r"was made for another base model: its adapter at 'model.layers.0.mlp.down_proj' is 48 wide, the module's output here is 32",
    ):
        add_frozen_adapter(model, tmp_path / "wide", "xx")
    named = get_peft_model(tiny_llama(), BottleneckConfig(bottleneck_size=4))
    named.peft_config["default"].base_model_name_or_path = "org/other-model"
    named.save_pretrained(tmp_path / "named")
    model.peft_config["task"].base_model_name_or_path = "org/this-model"
    with pytest.raises(ValueError, match=r"was made for base model 'org/other-model', but this model is 'org/this-model'"):
        add_frozen_adapter(model, tmp_path / "named", "xx")


# ---------------------------------------------------------------------------------------------- generator
def madg(arch="llama", ls=False, languages=("deu", "eng", "fin"), **kw):
    config = MADGConfig(languages=list(languages), bottleneck_size=4, layer_embeddings=ls, init_weights=False, **kw)
    return get_peft_model(BUILDERS[arch](), config)


@pytest.mark.parametrize("ls", [False, True], ids=["madg", "madg-ls"])
def test_generated_weights_equal_the_hand_computation(ls):
    model = madg(ls=ls)
    gen = model.base_model.madg_generator["default"]
    h, m = 32, 4
    t = uriel_vector("fin")
    lam = gen.V.detach() @ t
    assert gen.V.shape == (32, 289)
    for b in range(2):
        if ls:
            assert gen.W.shape == (2 * h * m, 64) and gen.layer_embedding.shape == (2, 32)
            theta = gen.W.detach() @ torch.cat([lam, gen.layer_embedding.detach()[b]])
        else:
            assert gen.W.shape == (2, 2 * h * m, 32)  # 2·h·m·n_b × d_l entries
            theta = torch.tensor([sum(gen.W[b, i, k].item() * lam[k].item() for k in range(32)) for i in range(0, 2 * h * m, 97)])
            theta_full = gen.W.detach()[b] @ lam
            torch.testing.assert_close(theta_full[::97], theta)
            theta = theta_full
        down, up = gen.adapter(b, t)
        assert torch.equal(down.detach(), theta[: h * m].view(m, h)) and torch.equal(up.detach(), theta[h * m :].view(h, m))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_madg_forward_trains_only_the_generator_and_refuses_mixed_batches(arch):
    model = madg(arch)
    x = inputs()
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert [n.rsplit(".", 1)[-1] for n in trainable] == ["V", "W"]
    a, b = out(model, x, language=["deu", "deu"]), out(model, x, language="fin")
    assert not torch.allclose(a, b)  # the languages' adapters differ
    with model.disable_adapter():
        torch.testing.assert_close(out(model, x, language="deu"), out(BUILDERS[arch](), x))
    out(model, x, language="deu").square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if p.requires_grad)
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    with pytest.raises(ValueError, match=r"must come from one language, got \['deu', 'fin'\]"):
        model(x, language=["deu", "fin"])


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_generated_adapter_for_an_unseen_language_loads_as_bottleneck(arch, tmp_path):
    model = madg(arch, ls=arch == "gpt2")
    x = inputs()
    assert "swh" not in model.peft_config["default"].languages
    expected = out(model, x, language="swh")
    path = generate_language_adapter(model, "swh", tmp_path / "swh")
    assert json.loads((tmp_path / "swh" / "adapter_config.json").read_text())["peft_type"] == "BOTTLENECK"
    loaded = PeftModel.from_pretrained(BUILDERS[arch](), path)
    torch.testing.assert_close(out(loaded, x), expected)
    # a user's own vector for a language URIEL lacks
    mine = torch.rand(289, generator=torch.Generator().manual_seed(3)).round()
    generate_language_adapter(model, "my-lang", tmp_path / "mine", typology=mine.tolist())
    model.peft_config["default"].typology_vectors = {"my-lang": mine.tolist()}
    torch.testing.assert_close(
        out(PeftModel.from_pretrained(BUILDERS[arch](), tmp_path / "mine"), x), out(model, x, language="my-lang")
    )


@pytest.mark.parametrize("ls", [False, True], ids=["madg", "madg-ls"])
def test_generator_save_load_round_trip(ls, tmp_path):
    model = madg(ls=ls, languages=["deu", "xx1"], typology_vectors={"xx1": [float(i % 2) for i in range(289)]})
    x = inputs()
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert sorted(k.rsplit(".", 1)[-1] for k in tensors) == sorted(["V", "W", "typology"] + (["layer_embedding"] if ls else []))
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path)
    for lang in ("deu", "xx1"):
        assert torch.equal(out(loaded, x, language=lang), out(model, x, language=lang))
    assert not any(p.requires_grad for p in loaded.parameters())
    trainable = PeftModel.from_pretrained(tiny_llama(), tmp_path, is_trainable=True)
    assert sorted(n.rsplit(".", 1)[-1] for n, p in trainable.named_parameters() if p.requires_grad) == sorted(
        ["V", "W"] + (["layer_embedding"] if ls else [])
    )


def test_feature_importance_is_the_column_norm_of_W_V(tmp_path, capsys):
    for ls in (False, True):
        model = madg(ls=ls)
        gen = model.base_model.madg_generator["default"]
        W = gen.W.detach()[..., :32].reshape(-1, 32)
        torch.testing.assert_close(gen.feature_importance(), (W @ gen.V.detach()).norm(dim=0), rtol=1e-4, atol=1e-5)
    model.save_pretrained(tmp_path / "gen")
    assert cli(["inspect", str(tmp_path / "gen"), "--top-features", "5", "--feature-plot", str(tmp_path / "f.png")]) == 0
    text = capsys.readouterr().out
    assert "MAD-G-LS (PEFT type MADG), 3 training languages: deu, eng, fin" in text and os.path.getsize(tmp_path / "f.png") > 0
    top = gen.feature_importance().argsort(descending=True)[:5].tolist()
    rows = [line.split()[0] for line in text.splitlines() if line[:2] in ("S_", "P_", "IN")]
    assert rows == [feature_names()[j] for j in top]


def test_the_installed_command_plots_features_though_lang2vec_installs_a_script_of_its_name(tmp_path):
    """The console script runs with its own folder (the environment's bin/) first on sys.path, where lang2vec's
    install puts a lang2vec.py script; the typology lookup must still find the lang2vec package."""
    import subprocess
    import sys

    command = os.path.join(os.path.dirname(sys.executable), "peft-sparse")
    if not os.path.isfile(command):
        pytest.skip(f"no installed peft-sparse command beside {sys.executable}")
    assert os.path.isfile(os.path.join(os.path.dirname(command), "lang2vec.py"))  # (what makes this test bite)
    madg().save_pretrained(tmp_path / "gen")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run([command, "inspect", str(tmp_path / "gen"), "--top-features", "3", "--feature-plot", str(tmp_path / "f.png")],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------- data and routing
def test_language_sampler_distribution():
    languages = ["a"] * 400 + ["b"] * 100 + ["c"] * 25 + ["d"] * 4000
    sampler = LanguageSampler(languages, batch_size=4, num_batches=6000, exponent=0.5, cap=1000, seed=1)
    weights = {"a": 400**0.5, "b": 100**0.5, "c": 25**0.5, "d": 1000**0.5}
    total = sum(weights.values())
    assert sampler.probabilities == pytest.approx({k: v / total for k, v in weights.items()})
    counts = {k: 0 for k in weights}
    for batch in sampler:
        names = {languages[i] for i in batch}
        assert len(names) == 1 and len(batch) == 4
        counts[names.pop()] += 1
    for k in weights:
        p = weights[k] / total
        assert abs(counts[k] / 6000 - p) < 4 * math.sqrt(p * (1 - p) / 6000)
    assert list(LanguageSampler(languages, 4, 10, seed=1)) == list(LanguageSampler(languages, 4, 10, seed=1))
    uniform = LanguageSampler(languages, 4, 10, exponent=0.0)
    assert set(uniform.probabilities.values()) == {0.25}


def test_language_collator_keeps_names_and_refuses_mixed_batches():
    collate = LanguageCollator(lambda feats: {"input_ids": torch.tensor([f["input_ids"] for f in feats])})
    batch = collate([{"input_ids": [1, 2], "language": "deu"}, {"input_ids": [3, 4], "language": "deu"}])
    assert batch["language"] == ["deu", "deu"] and batch["input_ids"].shape == (2, 2)
    with pytest.raises(ValueError, match="must come from one language"):
        collate([{"input_ids": [1], "language": "deu"}, {"input_ids": [3], "language": "fin"}])
    with pytest.raises(KeyError, match="example 1 of the batch has no 'language' field"):
        collate([{"input_ids": [1], "language": "deu"}, {"input_ids": [3]}])


def test_madg_trains_through_trainer_with_single_language_batches(tmp_path):
    model = madg(languages=["deu", "fin"])
    g = torch.Generator().manual_seed(0)
    rows = [
        {"input_ids": torch.randint(0, 97, (8,), generator=g).tolist(), "language": lang} for lang in ["deu"] * 12 + ["fin"] * 12
    ]
    for r in rows:
        r["labels"] = r["input_ids"]
    seen = []
    model.base_model.model.register_forward_pre_hook(
        lambda m, a: seen.append(model.base_model.madg_generator["default"].language)
    )
    sampler = LanguageSampler([r["language"] for r in rows], batch_size=4, num_batches=6, seed=0)
    stream = LanguageBatchStream(rows, sampler)
    collate = LanguageCollator(lambda feats: {k: torch.tensor([f[k] for f in feats]) for k in ("input_ids", "labels")})
    before = model.base_model.madg_generator["default"].W.detach().clone()
    args = TrainingArguments(tmp_path, per_device_train_batch_size=4, max_steps=6, learning_rate=1e-2, report_to=[],
                             remove_unused_columns=False, save_strategy="no", use_cpu=True)  # fmt: skip
    Trainer(model=model, args=args, train_dataset=stream, data_collator=collate).train()
    expected = [rows[b[0]]["language"] for b in LanguageSampler([r["language"] for r in rows], 4, 6, seed=0)]
    assert seen[: len(expected)] == expected
    assert not torch.equal(before, model.base_model.madg_generator["default"].W.detach())


def test_multi_source_task_training_switches_generated_language_adapters(tmp_path):
    generator = madg(languages=["deu", "fin"])
    for lang in ("deu", "fin"):
        generate_language_adapter(generator, lang, tmp_path / lang)
    model = get_peft_model(tiny_llama(), BottleneckConfig(bottleneck_size=4, init_weights=False), adapter_name="task")
    for lang in ("deu", "fin"):
        add_frozen_adapter(model, tmp_path / lang, f"la_{lang}")
    switch = LanguageSwitch(model, {"deu": "la_deu", "fin": "la_fin"}, task="task")
    x = inputs()
    routed = {lang: out(model, x, language=[lang, lang]) for lang in ("deu", "fin")}
    switch.remove()
    for lang in ("deu", "fin"):
        stack(model, [f"la_{lang}"], "task")
        torch.testing.assert_close(routed[lang], out(model, x))
    assert not torch.allclose(routed["deu"], routed["fin"])


def test_madg_layers_cover_every_block():
    model = madg("bert")
    assert [n for n, _ in madg_layers(model)] == FFN["bert"]
    assert [m.madg_block["default"] for _, m in madg_layers(model)] == [0, 1]
    assert all(isinstance(m, MADGLayer) for _, m in madg_layers(model))


# ---------------------------------------------------------------------------------------------- the demonstration
def test_the_madg_recipe_refuses_hub_data_clearly_offline(monkeypatch):
    import importlib.util

    from .test_readme_and_recipes import ROOT

    spec = importlib.util.spec_from_file_location("madg_typology", ROOT / "recipes" / "madg_typology.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit, match="--hub-dataset wikimedia/wikipedia: the hub is switched off here"):
        recipe.main(["--hub-dataset", "wikimedia/wikipedia", "--train-languages", "deu", "--hub-configs", "deu=20231101.de", "nld=20231101.nl"])
    with pytest.raises(SystemExit, match="--hub-configs names no subset for: nld"):
        recipe.main(["--hub-dataset", "x/y", "--train-languages", "deu", "--hub-configs", "deu=a"])


def test_the_madg_recipe_runs_every_stage(tmp_path):
    import importlib.util
    from argparse import Namespace

    from .test_cross_lingual_recipe import _rows, _tokenizer
    from .test_readme_and_recipes import ROOT

    spec = importlib.util.spec_from_file_location("madg_typology", ROOT / "recipes" / "madg_typology.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    args = Namespace(train_languages=["deu", "jpn", "eng"], held_out="nld", steps=2, lr=1e-3, direct_lr=1e-3, bottleneck_size=4,
                     features=4, fraction=1.0, batch_size=2, max_length=32, seed=0)  # fmt: skip
    result = recipe.run(tiny_llama(), _tokenizer(), _rows(8, 1), _rows(4, 3), args, tmp_path)
    assert len(result["heldout_loss"]) == 4 and all(math.isfinite(v) for v in result["heldout_loss"].values())
    assert result["closest"][0] == "deu"  # Dutch is typologically closest to German
    for name in ("generated-nld", "generated-eng"):
        assert json.loads((tmp_path / name / "adapter_config.json").read_text())["peft_type"] == "BOTTLENECK"
    assert json.loads((tmp_path / "generator" / "adapter_config.json").read_text())["layer_embeddings"] is True


def test_madg_trains_an_encoder_with_masked_lm_through_the_language_collator(tmp_path):
    """Multilingual MLM for encoders (thesis §3.4.3): a tiny BERT MLM, transformers' MLM collator inside the
    LanguageCollator, single-language batches from the LanguageSampler, a Trainer run that changes V and W."""
    from transformers import BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling

    from .models import tiny_tokenizer

    torch.manual_seed(0)
    config = BertConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=64)  # fmt: skip
    model = get_peft_model(BertForMaskedLM(config), MADGConfig(languages=["deu", "fin"], bottleneck_size=4))
    tok = tiny_tokenizer()
    tok.mask_token = "t3"
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(4, 97, (12,), generator=g).tolist(), "language": lang} for lang in ["deu"] * 16 + ["fin"] * 16]
    collate = LanguageCollator(DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.3))
    batch = collate(rows[:4])
    assert batch["language"] == ["deu"] * 4 and (batch["labels"] != -100).any() and (batch["labels"] == -100).any()
    generator = model.base_model.madg_generator["default"]
    before = {n: p.detach().clone() for n, p in generator.named_parameters()}
    stream = LanguageBatchStream(rows, LanguageSampler([r["language"] for r in rows], batch_size=4, num_batches=5, seed=0))
    args = TrainingArguments(tmp_path, per_device_train_batch_size=4, max_steps=5, learning_rate=1e-2, report_to=[],
                             remove_unused_columns=False, save_strategy="no", use_cpu=True)  # fmt: skip
    Trainer(model=model, args=args, train_dataset=stream, data_collator=collate).train()
    assert all(not torch.equal(before[n], p.detach()) for n, p in generator.named_parameters())
