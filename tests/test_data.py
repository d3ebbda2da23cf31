"""peft_sparse.data: synthetic languages and single-language batches."""

import pytest
import torch

from peft_sparse.data import SingleLanguageBatchSampler, batch_language, check_single_language, make_languages, word_token_ids

WORDS = ["cat", "dog", "house", "tree", "river", "stone", "light", "water", "bird", "cloud", "field", "road"]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["<s>", "</s>", "<pad>"] + [f"Ġ{w}" for w in WORDS] + ["Ġ42", "Ġ", "ab", "▁sun", "Ġé"]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def test_word_tokens_are_whole_alphabetic_words_with_a_space_marker():
    tok = _tokenizer()
    ids = word_token_ids(tok)
    names = {tok.convert_ids_to_tokens(i) for i in ids}
    assert names == {f"Ġ{w}" for w in WORDS} | {"▁sun"}


def test_a_language_permutes_a_fraction_of_the_words_without_fixed_points_and_inverts():
    tok = _tokenizer()
    langs = make_languages(tok, ["en", "xa", "xb"], fraction=0.5, seed=0)
    assert torch.equal(langs["en"].table, torch.arange(len(tok)))
    words = set(word_token_ids(tok))
    for name in ("xa", "xb"):
        lang = langs[name]
        moved = torch.nonzero(lang.table != torch.arange(len(tok))).squeeze(1)
        assert set(moved.tolist()) == set(lang.words.tolist()) <= words  # only word tokens, each one moved
        assert lang.words.numel() == round(0.5 * len(words))
        assert sorted(lang.table.tolist()) == list(range(len(tok)))  # a permutation
        ids = list(range(len(tok)))
        assert lang.inverse().translate(lang.translate(ids)) == ids
        x = torch.tensor([[0, 3, 4], [5, 6, 1]])
        assert torch.equal(lang.inverse().translate(lang.translate(x)), x)
    assert not torch.equal(langs["xa"].table, langs["xb"].table)
    # a language depends on its name and the seed only
    again = make_languages(tok, ["xb"], fraction=0.5, seed=0)["xb"]
    assert torch.equal(again.table, langs["xb"].table)
    assert not torch.equal(make_languages(tok, ["xb"], fraction=0.5, seed=1)["xb"].table, langs["xb"].table)


def test_bad_language_input_is_refused_clearly():
    tok = _tokenizer()
    with pytest.raises(ValueError, match="fraction=0"):
        make_languages(tok, ["xa"], fraction=0)
    with pytest.raises(ValueError, match="distinct"):
        make_languages(tok, ["xa", "xa"])
    lang = make_languages(tok, ["xa"])["xa"]
    with pytest.raises(ValueError, match="token id -1"):
        lang.translate([1, -1])
    assert lang.translate([999]) == [999]  # past the tokenizer's vocabulary: no word, unchanged


@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_hold_one_language_and_cover_every_example_once(drop_last):
    languages = ["en"] * 10 + ["xa"] * 7 + ["xb"] * 5
    sampler = SingleLanguageBatchSampler(languages, batch_size=3, seed=0, drop_last=drop_last)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    for b in batches:
        assert len({languages[i] for i in b}) == 1
        assert len(b) == 3 or not drop_last
    seen = sorted(i for b in batches for i in b)
    if drop_last:
        assert len(seen) == 9 + 6 + 3 and len(set(seen)) == len(seen)
    else:
        assert seen == list(range(len(languages)))
    assert len({languages[b[0]] for b in batches[:4]}) > 1  # languages interleave
    assert list(SingleLanguageBatchSampler(languages, 3, seed=0, drop_last=drop_last)) == batches
    other = SingleLanguageBatchSampler(languages, 3, seed=0, drop_last=drop_last)
    other.set_epoch(1)
    assert list(other) != batches


def test_a_mixed_batch_is_refused_with_its_languages_named():
    assert check_single_language(["xa", "xa"]) == "xa"
    with pytest.raises(ValueError, match=r"\['en', 'xa'\]"):
        check_single_language(["xa", "en", "xa"])
    assert batch_language({"language": ["xb"] * 2, "input_ids": None}) == "xb"
    with pytest.raises(KeyError, match="'language'"):
        batch_language({"input_ids": None})
    with pytest.raises(ValueError, match="batch_size=0"):
        SingleLanguageBatchSampler(["en"], batch_size=0)


def test_the_sampler_drives_a_dataloader():
    from torch.utils.data import DataLoader

    data = [{"x": i, "language": lang} for i, lang in enumerate(["en", "xa"] * 6)]
    loader = DataLoader(data, batch_sampler=SingleLanguageBatchSampler([r["language"] for r in data], 4, seed=2),
                        collate_fn=lambda rows: {"x": [r["x"] for r in rows], "language": [r["language"] for r in rows]})  # fmt: skip
    got = [batch_language(b) for b in loader]
    assert sorted(got) == ["en", "en", "xa", "xa"]


def test_typological_languages_share_the_renamings_of_shared_features_and_reorder_words():
    from peft_sparse.data import make_typological_languages

    tok = _tokenizer()  # 13 word tokens
    names = ["S_SOV", "f1", "f2", "f3"]
    vectors = {"a": [0, 1, 0, 0], "b": [0, 1, 1, 0], "c": [1, 0, 1, 1], "d": [0, 0, 0, 0]}
    langs = make_typological_languages(tok, vectors, names, features=3, fraction=1.0, seed=0)
    assert torch.equal(langs["d"].table, torch.arange(len(tok))) and langs["d"].reorder is None
    words = set(word_token_ids(tok))
    renamed = {k: {i for i in range(len(tok)) if int(langs[k].table[i]) != i} for k in vectors}
    assert renamed["a"] < renamed["b"] and renamed["a"].isdisjoint(renamed["c"]) and renamed["b"] - renamed["a"] <= renamed["c"]
    assert all(renamed[k] <= words for k in vectors)
    for i in renamed["a"]:  # the shared feature f1 renames its tokens the same way in a and b
        assert langs["a"].table[i] == langs["b"].table[i]
    # c is verb-final (S_SOV): adjacent word tokens swap places; non-words stay and break pairs
    ids = [0, 3, 4, 5, 1, 6, 7, 2]
    t = langs["c"].translate(ids)
    mapped = [int(langs["c"].table[i]) for i in ids]
    assert t == [mapped[0], mapped[2], mapped[1], mapped[3], mapped[4], mapped[6], mapped[5], mapped[7]]
    for lang in langs.values():
        assert lang.inverse().translate(lang.translate(ids)) == ids
    with pytest.raises(ValueError, match="order_feature='S_XYZ' is not among the feature names"):
        make_typological_languages(tok, vectors, names, order_feature="S_XYZ")
    with pytest.raises(ValueError, match="typology vectors have 4 entries but feature_names names 3"):
        make_typological_languages(tok, vectors, names[:3])
