"""MAD-G offline: a typology-conditioned adapter generator, and a generated adapter for a held-out language.

Real multilingual corpora are not reachable offline, so every language here is *synthetic* but driven by
the real URIEL vector of a real language (:func:`peft_sparse.data.make_typological_languages`): the 24
typological features that vary most across the chosen languages each own a group of word tokens renamed by
one fixed permutation, applied in a language exactly when it has that feature, and a verb-final (``S_SOV``)
language swaps adjacent words. Typologically close languages are then close in text as well.

1. Train a MAD-G-LS generator (causal LM; every batch from one language, languages drawn
   ∝ min(n, cap)^0.5 as thesis §3.4.3) on the training languages.
2. Generate an adapter for the held-out language from its URIEL vector alone.
3. Held-out causal-LM loss on the held-out language's test text (lower is better): no adapter; the English
   adapter (MAD-G-en); the generated one; a bottleneck adapter trained directly on that language for as many
   steps (MAD-X, the upper reference).

    python recipes/madg_typology.py                      # SmolLM2-135M-Instruct on CPU, about 15 minutes
    python recipes/madg_typology.py --steps 20 --limit 16 # a quicker look
    # real text when the hub is reachable: one subset per language (ISO 639-3 = subset name)
    python recipes/madg_typology.py --hub-dataset wikimedia/wikipedia --hub-configs eng=20231101.en deu=20231101.de \\
        fra=20231101.fr jpn=20231101.ja --train-languages eng deu fra --held-out jpn

With ``--hub-dataset`` every language's text comes from its own subset of that dataset (``--text-column``,
``--hub-rows`` rows for training and a tenth as many held out) instead of a synthetic surface.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from peft import PeftModel, get_peft_model  # noqa: E402

from peft_sparse import BottleneckConfig, MADGConfig, generate_language_adapter  # noqa: E402
from peft_sparse.data import LanguageSampler, make_typological_languages  # noqa: E402
from peft_sparse.methods.madg import feature_names, uriel_vector  # noqa: E402

TRAIN = ["eng", "deu", "fra", "spa", "rus", "tur", "jpn", "hin", "ind", "swh"]
HELD_OUT = "nld"


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def text_ids(tokenizer, row, max_length: int) -> list[int]:
    text = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"][:max_length]


def collate(rows: list, pad_id: int) -> dict:
    width = max(map(len, rows))
    return {
        "input_ids": torch.tensor([r + [pad_id] * (width - len(r)) for r in rows]),
        "labels": torch.tensor([r + [-100] * (width - len(r)) for r in rows]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
    }


def train(model, batches, steps: int, lr: float) -> dict:
    """A plain loop; ``batches`` yields (batch, language)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / steps)
    model.train()
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        batch, language = next(batches)
        loss = model(**batch, **({"language": language} if language else {})).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "seconds": round(time.perf_counter() - start, 1),
        "first_loss": losses[0],
        "last_loss": sum(losses[-5:]) / len(losses[-5:]),
    }


@torch.no_grad()
def heldout_loss(model, rows: list, pad_id: int, batch_size: int = 8) -> float:
    model.eval()
    total, tokens = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = collate(rows[start : start + batch_size], pad_id)
        n = int((batch["labels"][:, 1:] != -100).sum())
        total += model(**batch).loss.item() * n
        tokens += n
    return total / tokens


def synthetic_texts(tokenizer, corpus: list, test: list, args) -> tuple:
    """{language: token-id lists} for training (every training language and the held-out one) and the held-out
    language's test texts: the bundled texts in each typology-driven synthetic language."""
    vectors = {c: uriel_vector(c) for c in args.train_languages + [args.held_out]}
    langs = make_typological_languages(
        tokenizer, vectors, feature_names(), features=args.features, fraction=args.fraction, seed=args.seed
    )
    ids = [text_ids(tokenizer, r, args.max_length) for r in corpus]
    texts = {c: [langs[c].translate(x) for x in ids] for c in vectors}
    return texts, [langs[args.held_out].translate(text_ids(tokenizer, r, args.max_length)) for r in test]


def hub_texts(tokenizer, args) -> tuple:
    """The same from a hub dataset, one subset per language."""
    from datasets import load_dataset

    texts, test = {}, None
    for code in args.train_languages + [args.held_out]:
        rows = load_dataset(args.hub_dataset, args.hub_configs[code], split=f"train[:{args.hub_rows + args.hub_rows // 10}]")
        ids = [tokenizer(r[args.text_column], add_special_tokens=False)["input_ids"][: args.max_length] for r in rows]
        texts[code] = ids[: args.hub_rows]
        if code == args.held_out:
            test = ids[args.hub_rows :]
    return texts, test


def run(base, tokenizer, corpus: list, test: list, args, out: Path, texts: Optional[tuple] = None) -> dict:
    vectors = {c: uriel_vector(c) for c in args.train_languages + [args.held_out]}
    pad = tokenizer.pad_token_id
    by_language, test_rows = texts if texts is not None else synthetic_texts(tokenizer, corpus, test, args)
    train_rows, train_names = [], []
    for c in args.train_languages:
        train_rows += by_language[c]
        train_names += [c] * len(by_language[c])
    similar = sorted(
        args.train_languages,
        key=lambda c: -float(torch.nn.functional.cosine_similarity(vectors[c], vectors[args.held_out], dim=0)),
    )
    print(f"held-out {args.held_out}: typologically closest training languages {similar[:3]}", flush=True)

    def language_batches(rows, names, seed):
        sampler = LanguageSampler(names, args.batch_size, num_batches=args.steps, exponent=0.5, seed=seed)
        for batch in sampler:
            yield collate([rows[i] for i in batch], pad), names[batch[0]]

    # 1. the generator
    config = MADGConfig(languages=args.train_languages, bottleneck_size=args.bottleneck_size, layer_embeddings=True)
    generator = get_peft_model(copy.deepcopy(base), config)
    timings = {"generator": train(generator, language_batches(train_rows, train_names, args.seed), args.steps, args.lr)}
    generator.save_pretrained(out / "generator")
    # 2. generated adapters: the held-out language (unseen in training) and English
    for code in (args.held_out, "eng"):
        generate_language_adapter(generator, code, out / f"generated-{code}")
    # 3. a bottleneck adapter trained directly on the held-out language (MAD-X)
    direct = get_peft_model(copy.deepcopy(base), BottleneckConfig(bottleneck_size=args.bottleneck_size))
    held_rows = by_language[args.held_out]
    timings["direct"] = train(
        direct,
        ((b, None) for b, _ in language_batches(held_rows, [args.held_out] * len(held_rows), args.seed)),
        args.steps,
        args.direct_lr,
    )
    results = {}

    def score(label, model):
        results[label] = heldout_loss(model, test_rows, pad)
        print(f"{label:<52} loss {results[label]:.4f}  perplexity {math.exp(results[label]):8.2f}", flush=True)

    print(f"\nheld-out causal-LM loss on {len(test_rows)} {args.held_out} texts", flush=True)
    score("no language adapter", base)
    score("English adapter (MAD-G-en)", PeftModel.from_pretrained(copy.deepcopy(base), out / "generated-eng"))
    score(
        f"generated {args.held_out} adapter (MAD-G-LS, unseen language)",
        PeftModel.from_pretrained(copy.deepcopy(base), out / f"generated-{args.held_out}"),
    )
    score(f"bottleneck adapter trained on {args.held_out} (MAD-X)", direct)
    return {"heldout_loss": results, "timings": timings, "closest": similar[:3]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--train-languages", nargs="+", default=TRAIN, help="ISO 639-3 codes of the generator's languages")
    parser.add_argument("--held-out", default=HELD_OUT, help="ISO 639-3 code of the language never seen in training")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=3e-4, help="the generator's learning rate")
    parser.add_argument("--direct-lr", type=float, default=1e-3, help="the directly trained adapter's learning rate")
    parser.add_argument("--bottleneck-size", type=int, default=64)
    parser.add_argument("--features", type=int, default=24, help="typological features that drive the synthetic surface")
    parser.add_argument("--fraction", type=float, default=0.5, help="fraction of word tokens the features rename")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=96)
    parser.add_argument("--limit", type=int, default=None, help="use only this many test texts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="outputs/madg")
    parser.add_argument("--hub-dataset", help="real text by hub name (needs the hub): one subset per language, see --hub-configs")
    parser.add_argument("--hub-configs", nargs="+", default=[], metavar="CODE=SUBSET", help="the dataset subset of each language")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--hub-rows", type=int, default=2000, help="training texts per language (a tenth more are held out)")
    args = parser.parse_args(argv)
    if args.held_out in args.train_languages:
        raise SystemExit(f"--held-out {args.held_out} is also a training language")
    texts = None
    if args.hub_dataset:
        args.hub_configs = dict(item.split("=", 1) for item in args.hub_configs)
        missing = [c for c in args.train_languages + [args.held_out] if c not in args.hub_configs]
        if missing:
            raise SystemExit(f"--hub-configs names no subset for: {' '.join(missing)}")
        if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
            raise SystemExit(f"--hub-dataset {args.hub_dataset}: the hub is switched off here (HF_HUB_OFFLINE); run without it for the synthetic languages")
    from peft_sparse.assets import load_model_and_tokenizer

    torch.manual_seed(args.seed)
    base, tokenizer = load_model_and_tokenizer(args.model)
    data = HERE / "data"
    corpus = read_jsonl(data / "skills2_train.jsonl") + read_jsonl(data / "skills_train.jsonl")
    test = (read_jsonl(data / "skills2_test.jsonl") + read_jsonl(data / "skills_test.jsonl"))[: args.limit]
    out = Path(args.output)
    if args.hub_dataset:
        try:
            texts = hub_texts(tokenizer, args)
        except Exception as error:  # noqa: BLE001  (any failure to reach the hub ends here, named)
            raise SystemExit(f"--hub-dataset {args.hub_dataset}: cannot load it ({type(error).__name__}: {error})") from None
    result = run(base, tokenizer, corpus, test, args, out, texts)
    (out / "results.json").write_text(json.dumps({**result, "args": vars(args)}, indent=1))
    return result


if __name__ == "__main__":
    main()
