"""recipes/cross_lingual.py end to end on a tiny model: language SFTs, single- and multi-source task SFTs,
zero-shot composition on a synthetic target language (the mechanism, not the quality: that is the README's)."""

import importlib.util
import json

import pytest
import torch

from .models import tiny_llama
from .test_readme_and_recipes import ROOT

WORDS = ["cat", "dog", "sun", "tree", "red", "blue", "one", "two", "big", "small", "copy", "say", "the", "word", "answer"]


def _recipe():
    spec = importlib.util.spec_from_file_location("cross_lingual", ROOT / "recipes" / "cross_lingual.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<pad>", "</s>"] + [f"▁{w}" for w in WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    out.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}answer{% endif %}"
    return out


def _rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        w = WORDS[int(torch.randint(0, 10, (1,), generator=g))]
        rows.append({"prompt": [{"role": "user", "content": f"say the word {w}"}], "completion": [{"role": "assistant", "content": w}], "answer": w})
    return rows


def test_the_recipe_runs_every_stage_and_scores_each_composition(tmp_path):
    recipe = _recipe()
    args = recipe.argparse.Namespace(language_steps=2, task_steps=2, density=0.1, l1_reg=0.1, lr=1e-2, fraction=0.5, batch_size=2,
                                     max_length=32, seed=0, language_embeddings=True, prefix_tuning=[2], prefix_lr=1e-2)  # fmt: skip
    result = recipe.run(tiny_llama(), _tokenizer(), _rows(8, 1), _rows(8, 2), _rows(4, 3), args, tmp_path)
    scores = result["exact_match"]
    assert len(scores) == 7 and all(0.0 <= v <= 1.0 for v in scores.values())
    assert "prefix tuning (2 tokens), xa" in scores and "prefix 2" in result["timings"]
    for name in ("lang-en/task", "lang-xa/task", "lang-xb/task", "task-single/task", "task-multi/task"):
        config = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert config["peft_type"] == "LT_SFT" and config["phase"] == "sparse"
    language = json.loads((tmp_path / "lang-xa/task/adapter_config.json").read_text())
    assert "model.embed_tokens" in language["tunable_weights_per_module"]  # language SFTs adapt the input embedding
    task = json.loads((tmp_path / "task-single/task/adapter_config.json").read_text())
    assert not any("embed" in k for k in task["tunable_weights_per_module"])
    assert set(result["timings"]) == {"language en", "language xa", "language xb", "task single-source", "task multi-source", "prefix 2"}
    # --resume keeps every saved adapter and scores them again: the same numbers
    (tmp_path / "results.json").write_text(json.dumps(result))
    args.resume = True
    again = recipe.run(tiny_llama(), _tokenizer(), _rows(8, 1), _rows(8, 2), _rows(4, 3), args, tmp_path)
    assert again["timings"]["language xa"] == result["timings"]["language xa"]
    assert {k: v for k, v in again["exact_match"].items() if "prefix" not in k} == {k: v for k, v in scores.items() if "prefix" not in k}


def test_hub_datasets_are_refused_clearly_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit, match="the hub is switched off"):
        _recipe().main(["--hub-dataset", "some/dataset"])
