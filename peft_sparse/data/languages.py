"""Synthetic languages: a fixed permutation of a subset of a tokenizer's word tokens."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence, Union

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

    def translate(self, ids: Union[Sequence[int], torch.Tensor]):
        """Token ids into this language (a list stays a list, a tensor a tensor of the same shape); ids past the
        tokenizer's vocabulary stay as they are."""
        t = torch.as_tensor(ids, dtype=torch.long)
        if t.numel() and int(t.min()) < 0:
            raise ValueError(f"{self.name}: token id {int(t.min())} is negative")
        # ids past the tokenizer's vocabulary (a model's padded embedding rows) are no words: unchanged
        inside = t < self.table.numel()
        out = torch.where(inside, self.table[t.clamp(max=self.table.numel() - 1)], t)
        return out.tolist() if not isinstance(ids, torch.Tensor) else out.to(ids.dtype)

    def inverse(self) -> "SyntheticLanguage":
        table = torch.empty_like(self.table)
        table[self.table] = torch.arange(self.table.numel())
        return SyntheticLanguage(f"{self.name}^-1", table, self.words)


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
