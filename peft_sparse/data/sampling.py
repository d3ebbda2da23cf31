"""Single-language batches for multi-source training: every batch comes from one language."""

from __future__ import annotations

from typing import Callable, Iterator, Mapping, Sequence

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


class LanguageSampler(torch.utils.data.Sampler):
    """``num_batches`` batches of dataset indices, each from one language drawn with probability
    ∝ min(n_l, cap)^exponent, n_l the language's example count (thesis §3.4.3: cap 500,000, exponent 0.5, which
    up-samples low-resource languages). Within a language, examples are taken in a shuffled order, reshuffled
    each time the language's examples run out. Deterministic in ``seed`` and the epoch (:meth:`set_epoch`)."""

    def __init__(self, languages: Sequence[str], batch_size: int, num_batches: int, exponent: float = 0.5, cap: int = 500_000, seed: int = 0):
        for name, value in (("batch_size", batch_size), ("num_batches", num_batches), ("cap", cap)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {name}={value!r}")
        if not exponent >= 0:
            raise ValueError(f"exponent must be ≥ 0, got exponent={exponent!r}")
        self.by_language: dict = {}
        for i, lang in enumerate(str(x) for x in languages):
            self.by_language.setdefault(lang, []).append(i)
        if not self.by_language:
            raise ValueError("languages is empty: no examples to sample")
        self.batch_size, self.num_batches, self.exponent, self.cap, self.seed, self.epoch = batch_size, num_batches, exponent, cap, seed, 0
        self.names = sorted(self.by_language)
        weights = torch.tensor([min(len(self.by_language[n]), cap) ** exponent for n in self.names], dtype=torch.float64)
        self.probabilities = dict(zip(self.names, (weights / weights.sum()).tolist()))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        probs = torch.tensor([self.probabilities[n] for n in self.names])
        queues = {n: [] for n in self.names}
        for _ in range(self.num_batches):
            name = self.names[int(torch.multinomial(probs, 1, generator=g))]
            batch = []
            while len(batch) < self.batch_size:
                if not queues[name]:
                    idx = self.by_language[name]
                    queues[name] = [idx[j] for j in torch.randperm(len(idx), generator=g).tolist()]
                batch.append(queues[name].pop())
            yield batch

    def __len__(self) -> int:
        return self.num_batches


class LanguageCollator:
    """Collate a batch with ``collate_fn`` after taking out the ``column`` naming each example's language, then put
    the names back as a list (checked single-language when ``single``): ``model(**batch)`` then receives
    ``language=[...]``, which the language routers (MAD-G, :class:`~peft_sparse.transfer.LanguageSwitch`,
    :class:`~peft_sparse.S4Router`) read. With a ``Trainer``, keep the column: ``remove_unused_columns=False``."""

    def __init__(self, collate_fn: Callable, column: str = "language", single: bool = True):
        self.collate_fn, self.column, self.single = collate_fn, column, single

    def __call__(self, features: Sequence[Mapping]) -> dict:
        missing = [i for i, f in enumerate(features) if self.column not in f]
        if missing:
            raise KeyError(f"example {missing[0]} of the batch has no {self.column!r} field naming its language")
        names = [str(f[self.column]) for f in features]
        if self.single:
            check_single_language(names)
        batch = self.collate_fn([{k: v for k, v in f.items() if k != self.column} for f in features])
        batch[self.column] = names
        return batch


class LanguageBatchStream(torch.utils.data.IterableDataset):
    """The examples of ``dataset`` in the order of a batch sampler (:class:`LanguageSampler`,
    :class:`SingleLanguageBatchSampler`), one by one: a ``Trainer`` or TRL trainer with
    ``per_device_train_batch_size`` equal to the sampler's batch size then cuts exactly the sampler's
    single-language batches (no Trainer subclass, no private method)."""

    def __init__(self, dataset, batch_sampler):
        self.dataset, self.batch_sampler = dataset, batch_sampler

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)

    def __iter__(self):
        for batch in self.batch_sampler:
            for i in batch:
                yield self.dataset[i]
