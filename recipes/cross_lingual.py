"""Zero-shot cross-lingual transfer with LT-SFT, offline: language SFT ⊕ task SFT (thesis Algorithm 1).

No multilingual model or corpus is reachable offline, so the languages are synthetic
(:mod:`peft_sparse.data`): each renames a fraction of the tokenizer's word tokens by a fixed
permutation, applied to every text. English ("en") is the source; "xa" the target, never seen with
task labels; "xb" a second source for multi-source training.

1. A language SFT per language: LT-SFT, causal LM on the *other* bundled task's text (skills2, no
   labels of the evaluated task), translated into the language.
2. A task SFT on the source: LT-SFT on the skills sample in English, trained under the frozen English
   language SFT (it holds φ_task only). Multi-source: the same, with batches from en and xb, each under
   its own language SFT (``LanguageSwitch``).
3. On the skills test set translated into xa: exact match of the base model, the task SFT alone,
   xa ⊕ task (single-source) and xa ⊕ task (multi-source); en ⊕ task on English as the source reference.

    python recipes/cross_lingual.py                       # SmolLM2-135M-Instruct on CPU
    python recipes/cross_lingual.py --language-steps 20 --task-steps 20 --limit 40   # a quicker look
    # real language corpora by hub name (needs the hub), task rows per language from files or hub:NAME
    python recipes/cross_lingual.py --hub-dataset NAME --language-column lang --languages en sw de \\
        --task-train en.jsonl --task-train-second de.jsonl --task-test sw.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from peft import get_peft_model  # noqa: E402

from peft_sparse import LTSFTConfig, LTSFTScheduler  # noqa: E402
from peft_sparse.data import SingleLanguageBatchSampler, make_languages  # noqa: E402
from peft_sparse.evaluation import normalize  # noqa: E402
from peft_sparse.transfer import LanguageSwitch, add_frozen_adapter, compose, stack  # noqa: E402

SOURCE, TARGET, SECOND = "en", "xa", "xb"
DEFAULT_LANGUAGES = (SOURCE, TARGET, SECOND)


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def chat_ids(tokenizer, messages, generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def task_example(tokenizer, row, language, max_length: int):
    """(ids, labels) of a task item in ``language``: the loss covers the answer only."""
    prompt = chat_ids(tokenizer, row["prompt"], True)
    full = chat_ids(tokenizer, row["prompt"] + row["completion"], False)[:max_length]
    ids = language.translate(full)
    return ids, [-100] * len(prompt) + ids[len(prompt) :]


def text_example(tokenizer, row, language, max_length: int):
    """(ids, labels) of unlabelled text in ``language`` (a ``text`` row, or a whole conversation; causal LM)."""
    if "text" in row:
        raw = tokenizer(row["text"], add_special_tokens=False)["input_ids"][:max_length]
    else:
        raw = chat_ids(tokenizer, row["prompt"] + row["completion"], False)[:max_length]
    ids = language.translate(raw)
    return ids, list(ids)


class Native:
    """A real language: its token ids are its own (the synthetic languages' translate/inverse, as identity)."""

    def translate(self, ids):
        return list(ids)

    def inverse(self):
        return self


def _of(data, name: str):
    """Rows for one language: ``data`` is the same rows for all (synthetic: translated per language) or a mapping."""
    return data[name] if isinstance(data, dict) else data


def collate(examples, pad_id: int):
    width = max(len(ids) for ids, _ in examples)
    ids = torch.tensor([x + [pad_id] * (width - len(x)) for x, _ in examples])
    labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in examples])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in examples])
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def lt_sft(model, batches, config: LTSFTConfig, lr: float, before_forward=None) -> dict:
    """Both LT-SFT phases over ``batches`` (an iterator of (batch, language or None)); returns timing and losses."""
    lt = LTSFTScheduler(model, adapter_name="task" if "task" in model.peft_config else None)
    optimizer = lt.attach(torch.optim.AdamW(lt.trainable_parameters(), lr=lr, weight_decay=0.0))
    model.train()
    losses, start = [], time.perf_counter()
    for step in range(config.dense_steps + config.sparse_steps):
        batch, language = next(batches)
        kwargs = {"language": [language] * batch["input_ids"].shape[0]} if language is not None else {}
        loss = model(**batch, **kwargs).loss
        loss.backward()
        loss = loss.detach()
        torch.nn.utils.clip_grad_norm_(lt.trainable_parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        lt.step()
        losses.append(loss.item())
    return {"seconds": time.perf_counter() - start, "first_loss": losses[0], "last_loss": sum(losses[-5:]) / len(losses[-5:])}


def cycle(examples, batch_size: int, pad_id: int, seed: int, languages=None):
    """Endless shuffled batches; with ``languages`` (one name per example) every batch is single-language."""
    epoch = 0
    while True:
        if languages is None:
            order = list(range(len(examples)))
            random.Random(seed + epoch).shuffle(order)
            groups = [order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
        else:
            sampler = SingleLanguageBatchSampler(languages, batch_size, seed=seed, drop_last=True)
            sampler.set_epoch(epoch)
            groups = list(sampler)
        for g in groups:
            yield collate([examples[i] for i in g], pad_id), (languages[g[0]] if languages is not None else None)
        epoch += 1


@torch.no_grad()
def exact_match(model, tokenizer, rows, language, batch_size: int = 16, max_new_tokens: int = 8) -> float:
    """Greedy answers to the rows' prompts in ``language``, read back into English and compared."""
    model.eval()
    back = language.inverse()
    pad = tokenizer.pad_token_id
    correct = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        prompts = [language.translate(chat_ids(tokenizer, r["prompt"], True)) for r in chunk]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        replies = greedy(model, ids, mask, max_new_tokens, pad)
        for row, reply in zip(chunk, replies):
            text = tokenizer.decode(back.translate(reply), skip_special_tokens=True)
            correct += normalize(text) == row["answer"]
    return correct / max(1, len(rows))


@torch.no_grad()
def greedy(model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, pad: int) -> torch.Tensor:
    """Greedy continuations of left-padded prompts: the new tokens, ``pad`` after each row's end of sequence.

    A PEFT prompt-learning model (prefix tuning) is decoded without a cache: transformers 5's ``generate`` passes
    its own cache and drops the prefix's key/values, so it would score the base model (checked in the tests).
    Every step runs the whole sequence with the prefix prepended, the real tokens numbered from 0 as in training (no position ids).
    """
    config = getattr(model, "active_peft_config", None)
    if config is None or not config.is_prompt_learning:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        return out[:, ids.shape[1] :]
    eos = model.generation_config.eos_token_id
    eos = torch.tensor(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    new = []
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        token = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].argmax(-1)
        token = torch.where(done, torch.full_like(token, pad), token)
        new.append(token)
        done |= torch.isin(token, eos)
        ids = torch.cat([ids, token[:, None]], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        if done.all():
            break
    return torch.stack(new, 1)


def language_target_modules(base) -> list:
    """Every linear layer name of the transformer blocks plus the input embedding's."""
    output = base.get_output_embeddings()
    names = {key.split(".")[-1] for key, m in base.named_modules() if isinstance(m, torch.nn.Linear) and m is not output}
    embedding = next(key for key, m in base.named_modules() if m is base.get_input_embeddings())
    return sorted(names) + [embedding]


def train_multi_source(model, tokenizer, train, langs, sources, args, out: Path, timings: dict) -> None:
    """The task SFT over two sources, each batch under its own language SFT (``LanguageSwitch``): the shared
    rows split between the two (synthetic), or each source's own rows (real data)."""
    pad = tokenizer.pad_token_id
    for name in sources:
        add_frozen_adapter(model, out / f"lang-{name}/task", f"lang_{name}")
    switch = LanguageSwitch(model, {n: f"lang_{n}" for n in sources}, task="task")
    data, names = [], []
    if isinstance(train, dict):
        pairs = [(name, r) for name in sources for r in train[name]]
    else:
        pairs = [(sources[i % 2], r) for i, r in enumerate(train)]
    for name, r in pairs:
        data.append(task_example(tokenizer, r, langs[name], args.max_length))
        names.append(name)
    timings["task multi-source"] = lt_sft(model, cycle(data, args.batch_size, pad, args.seed, names), model.peft_config["task"], args.lr)
    switch.remove()
    model.save_pretrained(out / "task-multi", selected_adapters=["task"])


def run(base, tokenizer, corpus, train, test, args, out: Path) -> dict:
    """``corpus``/``train``/``test``: rows shared by the synthetic languages, or mappings language → rows (real data)."""
    SOURCE, TARGET, SECOND = getattr(args, "languages", None) or DEFAULT_LANGUAGES  # noqa: N806 (real codes with --languages)
    if isinstance(corpus, dict):  # real languages: text as it is
        langs = {name: Native() for name in (SOURCE, TARGET, SECOND)}
    else:
        langs = make_languages(tokenizer, [SOURCE, TARGET, SECOND], fraction=args.fraction, seed=args.seed)
    pad = tokenizer.pad_token_id
    config = dict(target_modules="all-linear", density=args.density, selection="global", l1_reg=args.l1_reg)
    timings = {}

    def fresh(steps, **overrides):
        model = get_peft_model(copy.deepcopy(base), LTSFTConfig(**{**config, **overrides}, dense_steps=steps, sparse_steps=steps), adapter_name="task")
        return model

    # language SFTs also adapt the input embedding (thesis §4.4.2; the tied output embedding is untied and frozen)
    language_targets = language_target_modules(base) if args.language_embeddings else config["target_modules"]
    earlier = {}
    if getattr(args, "resume", False) and (out / "results.json").exists():
        earlier = json.loads((out / "results.json").read_text()).get("timings", {})

    def done(folder: str, label: str) -> bool:
        """--resume: a stage whose adapter is already saved is kept (with its recorded timing)."""
        if getattr(args, "resume", False) and (out / folder / "task" / "adapter_config.json").exists():
            timings[label] = earlier.get(label, "kept from an earlier run")
            print(f"{label}: kept {out / folder / 'task'}", flush=True)
            return True
        return False

    # 1. language SFTs: causal LM on the other task's text, in each language
    for name in (SOURCE, TARGET, SECOND):
        if done(f"lang-{name}", f"language {name}"):
            continue
        model = fresh(args.language_steps, target_modules=language_targets)
        data = [text_example(tokenizer, r, langs[name], args.max_length) for r in _of(corpus, name)]
        timings[f"language {name}"] = lt_sft(model, cycle(data, args.batch_size, pad, args.seed), model.peft_config["task"], args.lr)
        model.save_pretrained(out / f"lang-{name}", selected_adapters=["task"])
    # 2. task SFT on the source, under its language SFT (single-source) ...
    if not done("task-single", "task single-source"):
        model = fresh(args.task_steps)
        add_frozen_adapter(model, out / f"lang-{SOURCE}/task", "lang")
        stack(model, ["lang"], "task")
        data = [task_example(tokenizer, r, langs[SOURCE], args.max_length) for r in _of(train, SOURCE)]
        timings["task single-source"] = lt_sft(model, cycle(data, args.batch_size, pad, args.seed), model.peft_config["task"], args.lr)
        model.save_pretrained(out / "task-single", selected_adapters=["task"])
    # ... and over two sources, each batch under its own language SFT (multi-source)
    if not done("task-multi", "task multi-source"):
        train_multi_source(fresh(args.task_steps), tokenizer, train, langs, (SOURCE, SECOND), args, out, timings)
    # 3. evaluation on the target language
    results = {}

    def score(label, dirs, language):
        model = compose(copy.deepcopy(base), dirs) if dirs else copy.deepcopy(base)
        results[label] = exact_match(model, tokenizer, _of(test, language), langs[language])
        print(f"{label:<42} {100 * results[label]:5.1f}%", flush=True)

    print(f"\nexact match on {len(_of(test, TARGET))} held-out items", flush=True)
    score(f"base model, {TARGET}", [], TARGET)
    score(f"task SFT only, {TARGET}", [out / "task-single/task"], TARGET)
    score(f"{TARGET} ⊕ task (single-source), {TARGET}", [out / f"lang-{TARGET}/task", out / "task-single/task"], TARGET)
    score(f"{TARGET} ⊕ task (multi-source: {SOURCE}+{SECOND}), {TARGET}", [out / f"lang-{TARGET}/task", out / "task-multi/task"], TARGET)
    score(f"{SOURCE} ⊕ task (source reference), {SOURCE}", [out / f"lang-{SOURCE}/task", out / "task-single/task"], SOURCE)
    # 4. the prompt-tuning baseline (Tu et al.): PEFT's prefix tuning, a prefix at every layer, trained on the source's
    # task data for as many steps as the task SFT's two phases, applied unchanged to the target language
    for length in getattr(args, "prefix_tuning", None) or []:
        model = prefix_model(base, length)
        data = [task_example(tokenizer, r, langs[SOURCE], args.max_length) for r in _of(train, SOURCE)]
        timings[f"prefix {length}"] = train_plain(model, cycle(data, args.batch_size, pad, args.seed), 2 * args.task_steps, args.prefix_lr)
        results[f"prefix tuning ({length} tokens), {TARGET}"] = exact_match(model, tokenizer, _of(test, TARGET), langs[TARGET])
        results[f"prefix tuning ({length} tokens), {SOURCE}"] = exact_match(model, tokenizer, _of(test, SOURCE), langs[SOURCE])
        for label in (f"prefix tuning ({length} tokens), {TARGET}", f"prefix tuning ({length} tokens), {SOURCE}"):
            print(f"{label:<42} {100 * results[label]:5.1f}%", flush=True)
    return {"exact_match": results, "timings": timings}


def prefix_model(base, length: int):
    """PEFT's own prefix tuning (``PrefixTuningConfig``): ``length`` trained key/value prefixes in every layer."""
    from peft import PrefixTuningConfig

    return get_peft_model(copy.deepcopy(base), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=length))


def train_plain(model, batches, steps: int, lr: float) -> dict:
    """AdamW with linear decay and no warm-up (the paper's prompt-tuning schedule) over ``steps`` batches."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / steps))
    model.train()
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        batch, _ = next(batches)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"seconds": time.perf_counter() - start, "first_loss": losses[0], "last_loss": sum(losses[-5:]) / len(losses[-5:])}


def load_real_data(args) -> tuple[dict, dict, dict]:
    """(corpus, train, test), each a mapping language → rows, for ``--hub-dataset``: unlabelled text per language
    from the hub dataset (``--language-column``, ``--text-column``), task rows from ``--task-train`` (source),
    ``--task-train-second`` and ``--task-test`` (target), ``--task-test-source`` (local JSONL/Parquet or hub:NAME,
    the bundled skills format: prompt messages, completion, answer)."""
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise SystemExit(f"--hub-dataset {args.hub_dataset}: the hub is switched off here (HF_HUB_OFFLINE); use the synthetic languages")
    if args.languages is None or args.language_column is None or not args.task_train or not args.task_test:
        raise SystemExit("--hub-dataset needs --languages SOURCE TARGET SECOND, --language-column, --task-train, --task-train-second and --task-test")
    source, target, second = args.languages
    from datasets import load_dataset

    from peft_sparse.recipe import read_rows

    try:
        data = load_dataset(args.hub_dataset, args.hub_config, split=args.hub_split)
    except Exception as error:  # noqa: BLE001  (any failure to reach the hub ends here, named)
        raise SystemExit(f"--hub-dataset {args.hub_dataset}: cannot load it from the hub ({type(error).__name__}: {error})") from None
    for column in (args.language_column, args.text_column):
        if column not in data.column_names:
            raise SystemExit(f"--hub-dataset {args.hub_dataset}: no column {column!r} (columns: {data.column_names})")
    corpus = {name: [] for name in (source, target, second)}
    for row in data:
        texts = corpus.get(row[args.language_column])
        if texts is not None and len(texts) < args.corpus_limit:
            texts.append({"text": row[args.text_column]})
    empty = [name for name, texts in corpus.items() if not texts]
    if empty:
        raise SystemExit(f"--hub-dataset {args.hub_dataset}: no text in languages {empty} (column {args.language_column!r})")
    train = {source: read_rows(args.task_train), second: read_rows(args.task_train_second) if args.task_train_second else []}
    if not train[second]:
        raise SystemExit("--task-train-second: the multi-source task SFT needs task rows in the second source language")
    test = {target: read_rows(args.task_test)[: args.limit]}
    test[source] = read_rows(args.task_test_source)[: args.limit] if args.task_test_source else test[target]
    return corpus, train, test


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--hub-dataset", help="real language corpora by hub name instead of the synthetic languages (needs the hub)")
    parser.add_argument("--hub-config", default=None)
    parser.add_argument("--hub-split", default="train")
    parser.add_argument("--language-column", default=None, help="--hub-dataset: the column naming each text's language")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--corpus-limit", type=int, default=20000, help="--hub-dataset: texts per language")
    parser.add_argument("--languages", nargs=3, default=None, metavar=("SOURCE", "TARGET", "SECOND"), help="--hub-dataset: the language codes")
    parser.add_argument("--task-train", help="--hub-dataset: task rows in the source language (JSONL/Parquet or hub:NAME)")
    parser.add_argument("--task-train-second", help="--hub-dataset: task rows in the second source language")
    parser.add_argument("--task-test", help="--hub-dataset: held-out task rows in the target language")
    parser.add_argument("--task-test-source", help="--hub-dataset: held-out task rows in the source language")
    parser.add_argument("--language-steps", type=int, default=40, help="steps of each LT-SFT phase of a language SFT")
    parser.add_argument("--task-steps", type=int, default=40, help="steps of each LT-SFT phase of the task SFT")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--no-language-embeddings", dest="language_embeddings", action="store_false",
                        help="language SFTs adapt the linear layers only (default: the input embedding too)")
    parser.add_argument("--l1-reg", type=float, default=0.0)
    parser.add_argument("--prefix-tuning", type=int, nargs="*", default=[16, 32], metavar="LENGTH",
                        help="prompt-tuning baseline: PEFT prefix tuning with these prefix lengths (none: skip it)")
    parser.add_argument("--prefix-lr", type=float, default=1e-2, help="learning rate of the prefix-tuning baseline")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--fraction", type=float, default=0.3, help="fraction of word tokens each synthetic language renames")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="use only this many test items")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="outputs/cross-lingual")
    parser.add_argument("--resume", action="store_true", help="keep the adapters an earlier run saved in --output; train and score the rest")
    args = parser.parse_args(argv)
    from peft_sparse.assets import load_model_and_tokenizer

    real = load_real_data(args) if args.hub_dataset else None  # (before the model: a bad source fails fast)
    torch.manual_seed(args.seed)
    base, tokenizer = load_model_and_tokenizer(args.model)
    if real is not None:
        result = run(base, tokenizer, *real, args, Path(args.output))
    else:
        args.languages = None
        data = HERE / "data"
        test = read_jsonl(data / "skills_test.jsonl")[: args.limit]
        result = run(base, tokenizer, read_jsonl(data / "skills2_train.jsonl"), read_jsonl(data / "skills_train.jsonl"), test, args, Path(args.output))
    (Path(args.output) / "results.json").write_text(json.dumps({**result, "args": vars(args)}, indent=1))
    return result


if __name__ == "__main__":
    main()
