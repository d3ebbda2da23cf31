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


def test_real_corpora_by_hub_name(tmp_path, monkeypatch):
    """--hub-dataset: language corpora from a hub dataset (here a stand-in for load_dataset), task rows from local
    files in each language, the same stages and scores with the real language codes."""
    import datasets

    from .models import tiny_llama

    recipe = _recipe()
    tiny_llama().save_pretrained(tmp_path / "model")
    _tokenizer().save_pretrained(tmp_path / "model")
    words = WORDS[:10]
    corpus = datasets.Dataset.from_dict({"lang": ["en", "sw", "de"] * 6, "content": [" ".join(words[i % 10 : i % 10 + 3]) for i in range(18)]})
    asked = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # (the stand-in answers instead of the hub)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config=None, split=None: asked.append((name, config, split)) or corpus)
    for name, seed in (("train-en", 1), ("train-de", 2), ("test-sw", 3)):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in _rows(6, seed)))
    argv = ["--model", str(tmp_path / "model"), "--hub-dataset", "org/corpora", "--language-column", "lang", "--text-column", "content",
            "--languages", "en", "sw", "de", "--task-train", str(tmp_path / "train-en.jsonl"), "--task-train-second",
            str(tmp_path / "train-de.jsonl"), "--task-test", str(tmp_path / "test-sw.jsonl"), "--language-steps", "1", "--task-steps", "1",
            "--density", "0.1", "--batch-size", "2", "--max-length", "32", "--prefix-tuning", "2", "--output", str(tmp_path / "out")]  # fmt: skip
    result = recipe.main(argv)
    assert asked == [("org/corpora", None, "train")]
    assert "sw ⊕ task (single-source), sw" in result["exact_match"] and "prefix tuning (2 tokens), sw" in result["exact_match"]
    assert (tmp_path / "out" / "lang-sw" / "task" / "adapter_config.json").is_file()
    with pytest.raises(SystemExit, match="needs --languages"):
        recipe.main(["--model", str(tmp_path / "model"), "--hub-dataset", "org/corpora"])
    with pytest.raises(SystemExit, match=r"no text in languages \['yo'\]"):
        recipe.main(argv[:10] + ["yo"] + argv[11:])


def test_prefix_tuning_is_scored_with_its_prefix():
    """transformers 5's generate() drops PEFT's prefix key/values; the recipe's decoding keeps them: its answers
    equal a plain cache-free greedy loop through the prefix model, per row, and differ from the base model's."""
    from peft import PrefixTuningConfig, get_peft_model

    recipe = _recipe()
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 3.0)
    model.eval()
    model.generation_config.eos_token_id = None
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    pad = 0
    ids = torch.tensor([[pad] * (5 - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (5 - len(p)) + [1] * len(p) for p in prompts])
    replies = recipe.greedy(model, ids, mask, 4, pad)
    for prompt, reply in zip(prompts, replies):
        seq = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(4):
                seq = torch.cat([seq, model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert reply.tolist() == seq[0, len(prompt) :].tolist()
    base = recipe.greedy(model.base_model, ids, mask, 4, pad)  # the model without the prefix, through generate()
    assert not torch.equal(replies, base)
