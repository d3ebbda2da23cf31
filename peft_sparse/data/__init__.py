"""Multilingual data offline: synthetic languages made from English text, and single-language batches.

No multilingual model or corpus is reachable offline, so cross-lingual methods (LT-SFT's language SFTs,
S⁴ masks, MAD-G) are demonstrated on *synthetic languages*: each is a fixed permutation of a subset of
the tokenizer's word tokens, applied to every token of a text. A model must learn the permutation
(the "language") to do a task in it; the task itself is unchanged.

    langs = make_languages(tokenizer, ["xa", "xb"], fraction=0.5, seed=0)
    ids = langs["xa"].translate(tokenizer(text)["input_ids"])      # same length, same task, new "words"
    sampler = SingleLanguageBatchSampler(dataset["language"], batch_size=8, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=...)
    check_single_language(batch_languages)                          # refuses a mixed batch
"""

from .languages import SyntheticLanguage, make_languages, make_typological_languages, word_token_ids
from .sampling import (
    LanguageBatchStream,
    LanguageCollator,
    LanguageSampler,
    SingleLanguageBatchSampler,
    batch_language,
    check_single_language,
)

__all__ = [
    "LanguageBatchStream", "LanguageCollator", "LanguageSampler", "SingleLanguageBatchSampler", "SyntheticLanguage",
    "batch_language", "check_single_language", "make_languages", "make_typological_languages", "word_token_ids",
]  # fmt: skip
