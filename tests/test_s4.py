"""S⁴-Tuning: Taylor-importance masks per language, masked updates, overlaps, files, bad input."""

import pytest
import torch
from peft import PeftModel

from peft_sparse import S4Config, S4Router, build_s4_model, detect_language_masks
from peft_sparse.methods.s4 import language_masks, layer_fractions, mask_overlaps, pack_bits, unpack_bits

from .models import MODELS, inputs, sparse_layers, tiny_llama


def _loaders(languages=("a", "b"), n=3):
    return {lang: [{"input_ids": inputs(seed=10 * j + i), "labels": inputs(seed=10 * j + i)} for i in range(n)] for j, lang in enumerate(languages)}


def _config(**kwargs):
    base = dict(target_modules="all-linear", density=0.2, languages=["a", "b"], importance_batches=2)
    base.update(kwargs)
    return S4Config(**base)


@pytest.mark.parametrize("normalization", ["none", "column"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_importance_is_the_top_p_of_abs_gradient_times_weight(kind, normalization):
    build, targets, _ = MODELS[kind]
    config = _config(target_modules=targets, score_normalization=normalization)
    loaders = _loaders()
    masks = detect_language_masks(build(), loaders, config)
    reference = build()
    for lang in ("a", "b"):
        reference.zero_grad()
        for p in reference.parameters():
            p.requires_grad_(True)
        for batch in loaders[lang][:2]:
            reference(**batch).loss.backward()
        for name, module in reference.named_modules():
            if name not in masks[lang]:
                continue
            score = (module.weight.grad * module.weight).abs()
            if kind == "gpt2":
                score = score.t()
            if normalization == "column":  # each score over its input column's RMS score
                score = score / score.pow(2).mean(0, keepdim=True).sqrt()
            k = round(0.2 * score.numel())
            expected = torch.sort(score.reshape(-1), descending=True, stable=True).indices[:k].sort().values
            assert torch.equal(masks[lang][name], expected), (lang, name)
    assert any(not torch.equal(masks["a"][n], masks["b"][n]) for n in masks["a"])


def test_detection_inside_no_grad_gives_the_same_masks():
    """The scores are gradients: a caller's torch.no_grad() (an evaluation loop, a generation setup) changes nothing."""
    config = _config()
    expected = detect_language_masks(tiny_llama(), _loaders(), config)
    with torch.no_grad():
        got = detect_language_masks(tiny_llama(), _loaders(), config)
    assert all(torch.equal(got[lang][k], expected[lang][k]) for lang in expected for k in expected[lang])


def test_init_weights_false_draws_the_values_from_torchs_generator():
    """As every sparse config's: torch.manual_seed decides the values, the detected masks decide the indices."""
    config = _config()
    masks = detect_language_masks(tiny_llama(), _loaders(), config)
    values = []
    for seed in (0, 0, 1):
        base = tiny_llama()  # (seeds torch itself)
        torch.manual_seed(seed)
        model = build_s4_model(base, _config(init_weights=False), masks)
        values.append(torch.cat([layer.sparse_values["default"].detach() for layer in sparse_layers(model)]))
    assert values[0].abs().min() > 0 and 0.01 < values[0].std() < 0.03  # N(0, 0.02²)
    assert torch.equal(values[0], values[1]) and not torch.equal(values[0], values[2])
    zeros = build_s4_model(tiny_llama(), _config(), masks)
    assert all(not layer.sparse_values["default"].any() for layer in sparse_layers(zeros))


def test_global_selection_is_the_top_p_of_all_targeted_weights_at_once():
    """selection='global' (the paper's p over all N parameters): the top p·N of the concatenated scores."""
    config = _config(selection="global")
    loaders = _loaders()
    masks = detect_language_masks(tiny_llama(), loaders, config)
    reference = tiny_llama()
    for lang in ("a", "b"):
        reference.zero_grad()
        for p in reference.parameters():
            p.requires_grad_(True)
        for batch in loaders[lang][:2]:
            reference(**batch).loss.backward()
        names = list(masks[lang])
        scores = [(reference.get_submodule(n).weight.grad * reference.get_submodule(n).weight).abs().reshape(-1) for n in names]
        flat = torch.cat(scores)
        k = round(0.2 * flat.numel())
        chosen = torch.sort(flat, descending=True, stable=True).indices[:k]
        start = 0
        for name, score in zip(names, scores):
            expected = chosen[(chosen >= start) & (chosen < start + score.numel())] - start
            assert torch.equal(masks[lang][name], expected.sort().values), (lang, name)
            start += score.numel()
        assert sum(m.numel() for m in masks[lang].values()) == k
        assert len({round(m.numel() / reference.get_submodule(n).weight.numel(), 2) for n, m in masks[lang].items()}) > 1  # uneven shares
    model = build_s4_model(tiny_llama(), config, masks)
    assert model.peft_config["default"].selection == "global"
    with pytest.raises(ValueError, match="selection='topk'"):
        _config(selection="topk")


def test_a_batch_of_one_language_changes_only_its_mask_bit_exactly():
    config = _config()
    model = build_s4_model(tiny_llama(), config, detect_language_masks(tiny_llama(), _loaders(), config))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    router = S4Router(model, optimizer)
    masks = list(language_masks(model).values())
    layers = sparse_layers(model)
    for t, lang in enumerate(["a", "b", "a", "a", "b"]):
        before = [l.sparse_values["default"].detach().clone() for l in layers]
        x = inputs(seed=t)
        model(input_ids=x, labels=x, language=[lang, lang]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        i = config.languages.index(lang)
        changed = 0
        for layer, mask, old in zip(layers, masks, before):
            new = layer.sparse_values["default"].detach()
            assert torch.equal(new[~mask[i]], old[~mask[i]]), (t, lang, layer.module_name)
            changed += int((new[mask[i]] != old[mask[i]]).sum())
        assert changed > 0
    with pytest.raises(ValueError, match=r"\['a', 'b'\]"):
        model(input_ids=x, labels=x, language=["a", "b"])
    with pytest.raises(KeyError, match="'zz'"):
        model(input_ids=x, labels=x, language=["zz", "zz"])
    router.remove()


def test_overlaps_and_fractions_on_constructed_masks():
    model = tiny_llama()
    config = _config(languages=["a", "b", "c"], target_modules=["q_proj"])
    n = 32 * 32
    masks = {lang: {} for lang in "abc"}
    for key in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"):
        masks["a"][key] = torch.arange(0, 100)
        masks["b"][key] = torch.arange(50, 150)
        masks["c"][key] = torch.arange(500, 600)
    peft_model = build_s4_model(model, config, masks)
    overlaps = mask_overlaps(peft_model)
    assert overlaps[("a", "b")] == pytest.approx(50 / 150) and overlaps[("a", "c")] == 0.0 and overlaps[("c", "c")] == 1.0
    fractions = layer_fractions(peft_model)
    assert fractions["model.layers.0.self_attn.q_proj"]["a"] == pytest.approx(100 / n)
    assert sum(l.sparse_values["default"].numel() for l in sparse_layers(peft_model)) == 2 * 250  # the union


def test_packed_bits_round_trip():
    mask = torch.rand(3, 37, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5)
    assert torch.equal(unpack_bits(packed, 37), mask)


def test_save_load_merge_and_compose(tmp_path):
    config = _config()
    model = build_s4_model(tiny_llama(), config, detect_language_masks(tiny_llama(), _loaders(), config))
    from .models import randomize_values

    randomize_values(model, scale=0.05)
    model.eval()
    x = inputs(seed=8)
    with torch.no_grad():
        out = model(x).logits
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    # the union of two p = 0.2 masks is far above density 1/32: its positions are stored as bitmaps
    assert all(k.endswith(("sparse_index_bits", "sparse_values", "sparse_masks")) for k in load_file(tmp_path / "adapter_model.safetensors"))
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path).eval()
    assert loaded.peft_config["default"].languages == ["a", "b"]
    for a, b in zip(language_masks(model).values(), language_masks(loaded).values()):
        assert torch.equal(a, b)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, out, rtol=0, atol=0)
        torch.testing.assert_close(loaded.merge_and_unload()(x).logits, out, rtol=1e-5, atol=1e-6)


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="density must be in"):
        _config(density=0.0)
    with pytest.raises(ValueError, match="density must be in"):
        _config(density=1.5)
    with pytest.raises(ValueError, match="languages must be"):
        _config(languages=[])
    with pytest.raises(ValueError, match="score_normalization must be 'none' or 'column', got score_normalization='row'"):
        _config(score_normalization="row")
    config = _config()
    with pytest.raises(ValueError, match=r"no data for languages \['b'\]"):
        detect_language_masks(tiny_llama(), {"a": _loaders()["a"]}, config)
    with pytest.raises(ValueError, match="language 'b' has no data"):
        detect_language_masks(tiny_llama(), {"a": _loaders()["a"], "b": []}, config)
    masks = detect_language_masks(tiny_llama(), _loaders(), config)
    bigger = tiny_llama(hidden_size=16, intermediate_size=24)  # another base model: smaller tensors
    with pytest.raises(ValueError, match="another model"):
        build_s4_model(bigger, config, masks)


def test_inspect_prints_the_overlap_table_and_writes_the_heatmap(tmp_path, capsys):
    from peft_sparse.cli import main

    config = _config(languages=["a", "b", "c"])
    model = build_s4_model(tiny_llama(), config, detect_language_masks(tiny_llama(), _loaders(("a", "b", "c")), config))
    model.save_pretrained(tmp_path / "s4")
    png = tmp_path / "overlap.png"
    assert main(["inspect", str(tmp_path / "s4"), "--overlap-heatmap", str(png)]) == 0
    out = capsys.readouterr().out
    assert "method: S4" in out and "Jaccard overlap" in out
    overlaps = mask_overlaps(model)
    assert f"{overlaps[('a', 'b')]:.3f}" in out
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"


def test_trainer_routes_languages_through_the_callback(tmp_path):
    from transformers import Trainer, TrainingArguments

    from peft_sparse import S4Callback
    from peft_sparse.data import LanguageBatchStream, LanguageCollator, SingleLanguageBatchSampler

    config = _config()
    model = build_s4_model(tiny_llama(), config, detect_language_masks(tiny_llama(), _loaders(), config))
    masks = list(language_masks(model).values())
    layers = sparse_layers(model)
    rows = [{"input_ids": inputs(seed=i, batch=1)[0].tolist(), "language": "b"} for i in range(8)]
    for r in rows:
        r["labels"] = r["input_ids"]
    before = [l.sparse_values["default"].detach().clone() for l in layers]
    collate = LanguageCollator(lambda feats: {k: torch.tensor([f[k] for f in feats]) for k in ("input_ids", "labels")})
    stream = LanguageBatchStream(rows, SingleLanguageBatchSampler([r["language"] for r in rows], batch_size=2, seed=0))
    args = TrainingArguments(tmp_path, per_device_train_batch_size=2, max_steps=4, learning_rate=1e-2, report_to=[],
                             remove_unused_columns=False, save_strategy="no", use_cpu=True)  # fmt: skip
    callback = S4Callback()
    Trainer(model=model, args=args, train_dataset=stream, data_collator=collate, callbacks=[callback]).train()
    assert callback.router is None  # removed at the end
    changed = 0
    for layer, mask, old in zip(layers, masks, before):
        new = layer.sparse_values["default"].detach()
        assert torch.equal(new[~mask[1]], old[~mask[1]])  # only language b's sub-network moved
        changed += int((new[mask[1]] != old[mask[1]]).sum())
    assert changed > 0


def test_the_s4_recipe_runs_every_arm(tmp_path):
    """recipes/s4_languages.py end to end on a tiny model: source fine-tuning, masks, S⁴, random masks, full
    fine-tuning, no adaptation; the overlap table and heatmap (the mechanism, not the quality: the README's)."""
    import importlib.util
    import json
    from argparse import Namespace

    from .test_cross_lingual_recipe import _rows, _tokenizer
    from .test_readme_and_recipes import ROOT

    spec = importlib.util.spec_from_file_location("s4_languages", ROOT / "recipes" / "s4_languages.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    args = Namespace(arms=list(recipe.ARMS), density=0.2, shots=4, steps=2, lr=1e-2, full_lr=1e-3, importance_batches=1, source_steps=2, source_lr=1e-2,
                     source_budget=500, fraction=0.5, batch_size=2, max_length=32, seed=0)  # fmt: skip
    result = recipe.run(tiny_llama(), _tokenizer(), _rows(16, 1), _rows(4, 3), args, tmp_path)
    assert set(result["exact_match"]) == {"no adaptation (source model)", "full fine-tuning", "random masks, p = 0.2", "S⁴ (Taylor masks, p = 0.2)",
                                          "S⁴, column-normalised, p = 0.2", "S⁴, global top p·N, p = 0.2"}  # fmt: skip
    assert all(0.0 <= v <= 1.0 for row in result["exact_match"].values() for v in row.values())
    s4 = result["overlaps"]["s4"]
    assert {"xa-xb", "xa-xc", "xb-xc"} <= set(s4) and all(0.0 <= v <= 1.0 for v in s4.values()) and s4["xa-xa"] == 1.0
    assert (tmp_path / "s4-overlap.png").stat().st_size > 0
    assert json.loads((tmp_path / "s4-adapter" / "adapter_config.json").read_text())["peft_type"] == "S4"


@pytest.mark.parametrize("count", [2, 3, 6])
def test_the_overlap_heatmaps_title_stays_clear_of_its_colour_bar(tmp_path, monkeypatch, count):
    """Rendered: the title's box meets neither the colour bar (ticks and label included) nor the grid, and all
    lie inside the figure."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from peft_sparse.plots import overlap_heatmap

    boxes = {}
    save = Figure.savefig

    def measuring_savefig(fig, *args, **kwargs):
        result = save(fig, *args, **kwargs)  # (drawn: the layout is final)
        renderer = fig.canvas.get_renderer()
        grid, bar = fig.axes
        title = next(t for t in [*fig.texts, grid.title] if t.get_text())
        boxes.update(title=title.get_window_extent(renderer), bar=bar.get_tightbbox(renderer), grid=grid.get_tightbbox(renderer),
                     figure=fig.bbox)  # fmt: skip
        return result

    monkeypatch.setattr(Figure, "savefig", measuring_savefig)
    languages = [f"l{i}" for i in range(count)]
    overlap_heatmap(languages, {(a, b): 1.0 if a == b else 0.25 for a in languages for b in languages}, str(tmp_path / "h.png"))
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    assert boxes["title"].width > 0 and not boxes["title"].overlaps(boxes["bar"]) and not boxes["title"].overlaps(boxes["grid"])
    for name in ("title", "bar", "grid"):
        box = boxes[name]
        assert box.x0 >= -1 and box.y0 >= -1 and box.x1 <= boxes["figure"].x1 + 1 and box.y1 <= boxes["figure"].y1 + 1, name
