"""Synthetic languages: a fixed permutation of a subset of a tokenizer's word tokens."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import torch

# how tokenizers mark a token that starts a word: GPT-2/Llama byte-level BPE ("Ġ"), SentencePiece ("▁")
WORD_START = ("Ġ", "▁")


def word_token_ids(tokenizer) -> list[int]:
    """Ids of the tokens that are a whole alphabetic word with its leading-space marker (e.g. "Ġhouse"), the
    tokens a synthetic language renames. Special tokens never qualify."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = tokenizer.get_vocab()
    out = []
    for token, idx in vocab.items():
        if idx in special or len(token) < 3 or token[0] not in WORD_START:
            continue
        word = token[1:]
        if word.isascii() and word.isalpha():
            out.append(idx)
    if len(out) < 2:
        raise ValueError(f"the tokenizer has {len(out)} word tokens (marked by {WORD_START}); a synthetic language needs at least 2")
    return sorted(out)


@dataclass(frozen=True)
class SyntheticLanguage:
    """A token-level language: ``table[i]`` is the id that token ``i`` becomes (a permutation of ``words``,
    the identity elsewhere)."""

    name: str
    table: torch.Tensor  # (vocab,) int64
    words: torch.Tensor  # the renamed ids (sorted)
    reorder: Optional[torch.Tensor] = None  # (vocab,) bool: word tokens whose adjacent pairs swap places (word order)

    def translate(self, ids: Union[Sequence[int], torch.Tensor]):
        """Token ids into this language (a list stays a list, a tensor a tensor of the same shape); ids past the
        tokenizer's vocabulary stay as they are."""
        t = torch.as_tensor(ids, dtype=torch.long)
        if t.numel() and int(t.min()) < 0:
            raise ValueError(f"{self.name}: token id {int(t.min())} is negative")
        # ids past the tokenizer's vocabulary (a model's padded embedding rows) are no words: unchanged
        inside = t < self.table.numel()
        out = torch.where(inside, self.table[t.clamp(max=self.table.numel() - 1)], t)
        if self.reorder is not None:
            out = _swap_word_pairs(out, self.reorder)
        return out.tolist() if not isinstance(ids, torch.Tensor) else out.to(ids.dtype)

    def inverse(self) -> "SyntheticLanguage":
        table = torch.empty_like(self.table)
        table[self.table] = torch.arange(self.table.numel())
        return SyntheticLanguage(f"{self.name}^-1", table, self.words, self.reorder)  # the pair swap is an involution


def _swap_word_pairs(ids: torch.Tensor, is_word: torch.Tensor) -> torch.Tensor:
    """Swap each two adjacent word tokens (left to right, along the last dimension); other tokens stay. The positions
    that swap depend only on which positions hold words, which the swap keeps: applying it twice is the identity."""
    flat = ids.reshape(-1, ids.shape[-1]) if ids.dim() else ids.reshape(1, 1)
    out = flat.clone()
    word = (flat < is_word.numel()) & is_word[flat.clamp(max=is_word.numel() - 1)]
    for row in range(flat.shape[0]):
        j, n = 0, flat.shape[1]
        while j + 1 < n:
            if word[row, j] and word[row, j + 1]:
                out[row, j], out[row, j + 1] = flat[row, j + 1], flat[row, j]
                j += 2
            else:
                j += 1
    return out.reshape(ids.shape)


def _seed(name: str, seed: int) -> int:
    return (zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1)) & 0x7FFFFFFF


def make_languages(tokenizer, names: Sequence[str], fraction: float = 0.5, seed: int = 0, identity: Sequence[str] = ("en",)) -> dict:
    """One :class:`SyntheticLanguage` per name: each renames a ``fraction`` of the word tokens (its own random
    subset, permuted among themselves without fixed points), seeded by (name, seed) so a language is the same
    whichever other languages are made. Names in ``identity`` (default ``"en"``) are the tokenizer's own text."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got fraction={fraction!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"language names must be distinct, got names={list(names)!r}")
    words = torch.tensor(word_token_ids(tokenizer))
    vocab = max(len(tokenizer), int(words.max()) + 1)
    out = {}
    for name in names:
        table = torch.arange(vocab)
        if name in identity:
            out[name] = SyntheticLanguage(name, table, torch.zeros(0, dtype=torch.long))
            continue
        g = torch.Generator().manual_seed(_seed(name, seed))
        count = max(2, round(fraction * words.numel()))
        chosen = words[torch.randperm(words.numel(), generator=g)[:count]].sort().values
        # a random cyclic shift of a random order: a permutation with no fixed point
        order = chosen[torch.randperm(count, generator=g)]
        table[order] = order.roll(int(torch.randint(1, count, (1,), generator=g)))
        out[name] = SyntheticLanguage(name, table, chosen)
    return out


def make_typological_languages(tokenizer, vectors: Mapping[str, Sequence[float]], feature_names: Sequence[str], features: int = 48,
                               fraction: float = 0.5, seed: int = 0, order_feature: str = "S_SOV") -> dict:  # fmt: skip
    """Synthetic languages whose surface is driven by their typology vectors, so that typologically close languages
    are close in text too (MAD-G's offline demonstration).

    The ``features`` typological features that vary most across ``vectors`` each own a disjoint group of the word
    tokens (``fraction`` of them in all) with one fixed permutation without fixed points. A language renames a
    group's tokens exactly when its vector has that feature (≥ 0.5): two languages share the renamings of the
    features they share. Its word order follows ``order_feature`` (default ``S_SOV``, verb-final): when set,
    adjacent word tokens swap places. ``vectors`` maps a language name to its vector (e.g. URIEL's, 289 values
    named by ``feature_names``)."""
    if not vectors:
        raise ValueError("make_typological_languages needs at least one typology vector")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got fraction={fraction!r}")
    names = list(vectors)
    table = torch.stack([torch.as_tensor(vectors[n], dtype=torch.float32).flatten() for n in names])  # (languages, F)
    if table.shape[1] != len(feature_names):
        raise ValueError(f"typology vectors have {table.shape[1]} entries but feature_names names {len(feature_names)}")
    if order_feature not in feature_names:
        raise ValueError(f"order_feature={order_feature!r} is not among the feature names")
    order_col = list(feature_names).index(order_feature)
    variance = table.var(0, unbiased=False) if len(names) > 1 else torch.ones(table.shape[1])
    variance[order_col] = -1.0  # word order is its own rule
    chosen = variance.argsort(descending=True)[: min(features, table.shape[1] - 1)]
    words = torch.tensor(word_token_ids(tokenizer))
    vocab = max(len(tokenizer), int(words.max()) + 1)
    g = torch.Generator().manual_seed(_seed("typology", seed))
    pool = words[torch.randperm(words.numel(), generator=g)[: max(2 * len(chosen), round(fraction * words.numel()))]]
    groups = [grp.sort().values for grp in pool.tensor_split(len(chosen))]
    cycles = []
    for grp in groups:  # one permutation without fixed points per feature, the same for every language
        order = grp[torch.randperm(grp.numel(), generator=g)]
        cycles.append((order, order.roll(int(torch.randint(1, grp.numel(), (1,), generator=g)))))
    is_word = torch.zeros(vocab, dtype=torch.bool)
    is_word[words] = True
    out = {}
    for i, name in enumerate(names):
        mapping = torch.arange(vocab)
        renamed = []
        for col, grp, (src, dst) in zip(chosen.tolist(), groups, cycles):
            if table[i, col] >= 0.5:
                mapping[src] = dst
                renamed.append(grp)
        renamed_ids = torch.cat(renamed).sort().values if renamed else torch.zeros(0, dtype=torch.long)
        reorder = is_word if table[i, order_col] >= 0.5 else None
        out[name] = SyntheticLanguage(name, mapping, renamed_ids, reorder)
    return out
