"""Single-language batches for multi-source training: every batch comes from one language."""

from __future__ import annotations

from typing import Iterator, Sequence

import torch


class SingleLanguageBatchSampler(torch.utils.data.Sampler):
    """Batches of dataset indices, each from one language (``languages[i]`` names example i's).

    Each epoch shuffles every language's examples, cuts them into batches (a language's last batch may be
    short unless ``drop_last``), and shuffles the batches of all languages together, so languages interleave
    in proportion to their data. Every index appears once per epoch; the order depends only on ``seed``
    and the epoch (:meth:`set_epoch`, as the Trainer calls it)."""

    def __init__(self, languages: Sequence[str], batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got batch_size={batch_size!r}")
        self.languages = [str(x) for x in languages]
        if not self.languages:
            raise ValueError("languages is empty: no examples to sample")
        self.batch_size, self.shuffle, self.seed, self.drop_last, self.epoch = batch_size, shuffle, seed, drop_last, 0
        self.by_language: dict[str, list[int]] = {}
        for i, lang in enumerate(self.languages):
            self.by_language.setdefault(lang, []).append(i)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        batches = []
        for lang in sorted(self.by_language):
            idx = self.by_language[lang]
            order = [idx[j] for j in torch.randperm(len(idx), generator=g).tolist()] if self.shuffle else list(idx)
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                if len(chunk) == self.batch_size or not self.drop_last:
                    batches.append(chunk)
        if self.shuffle:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        n = 0
        for idx in self.by_language.values():
            n += len(idx) // self.batch_size if self.drop_last else -(-len(idx) // self.batch_size)
        return n


def check_single_language(languages: Sequence[str], where: str = "batch") -> str:
    """The one language of a batch; a clear error if it mixes several (or is empty)."""
    seen = sorted({str(x) for x in languages})
    if len(seen) != 1:
        raise ValueError(
            f"a multi-source {where} must come from one language, got {seen}: build the loader with "
            "peft_sparse.data.SingleLanguageBatchSampler" if seen else f"the {where} names no language"
        )
    return seen[0]


def batch_language(batch: dict, column: str = "language") -> str:
    """The language of a collated batch from its ``column`` (a list of names), checked single."""
    if column not in batch:
        raise KeyError(f"the batch has no {column!r} column naming its language; it has {sorted(batch)}")
    return check_single_language(batch[column])
