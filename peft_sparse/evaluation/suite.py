"""The instruction-tuning benchmark suite of thesis App. E.1 (after Wang et al., 2023):

* **MMLU** — 5-shot, 4 choices: the letter with the highest next-token log-probability after ``Answer:``;
  accuracy (per subject and overall). Shots: the subject's first 5 ``dev`` items.
* **GSM** — 8-shot, 200 items: greedy generation, the last number of the reply against the number after
  ``####`` in the reference; exact match.
* **BBH** — 3-shot, 40 items per task: greedy generation, the answer after "So the answer is" (else the
  first line) against the target; exact match per task and overall. Shots: each task's first 3 items.
* **TyDiQA** (GoldP) — 1-shot, 100 items per language: the passage, the question and a greedy answer;
  token-level F1 against the best of the references (SQuAD normalisation).
* **HumanEval** — sampled at temperature 0.1, pass@1: prompt + completion + the tests run in a separate
  Python process (isolated mode, fresh temporary directory, CPU-time, memory and wall-clock limits, process
  creation, file removal and network sockets disabled), only after the user opts in to running model-written
  code (``allow_code_execution=True`` or ``HF_ALLOW_CODE_EVAL=1``, as ``evaluate``'s ``code_eval``).

Each task takes rows (``load_task`` reads them from a local JSONL file or by hub name, with a clear error
offline) and a model adapter: :class:`HFModel` wraps a transformers/PEFT model and tokenizer; anything with
``generate(prompts, max_new_tokens, temperature)`` and ``choice_logprobs(prompt, options)`` will do (the
tests pass simple stand-ins).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import string
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..core.merging import merged_for_inference

# ------------------------------------------------------------------------------------------ data
HUB = {
    "mmlu": ("cais/mmlu", "all", "test"),
    "gsm": ("openai/gsm8k", "main", "test"),
    "bbh": ("lukaemon/bbh", None, "test"),
    "tydiqa": ("google-research-datasets/tydiqa", "secondary_task", "validation"),
    "humaneval": ("openai/openai_humaneval", None, "test"),
}
TASKS = tuple(HUB)
SHOT_SPLITS = {"mmlu": "dev", "gsm": "train"}  # where the shots come from on the hub


def load_task(task: str, source: Optional[str] = None, split: Optional[str] = None) -> list[dict]:
    """Rows of ``task`` from a local ``.jsonl`` file (``source``) or by hub name (default: :data:`HUB`'s)."""
    if task not in HUB:
        raise ValueError(f"unknown task {task!r}; the suite has {list(TASKS)}")
    if source is not None and Path(source).suffix == ".jsonl":
        if not Path(source).is_file():
            raise ValueError(f"{task}: data file {source!r} does not exist")
        with open(source) as f:
            return [json.loads(line) for line in f if line.strip()]
    name, config, default_split = HUB[task]
    name = source or name
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise ValueError(f"{task}: {name} is a hub dataset, but the hub is switched off here (HF_HUB_OFFLINE); pass a local .jsonl")
    from datasets import load_dataset

    try:
        return list(load_dataset(name, config, split=split or default_split))
    except Exception as error:  # noqa: BLE001  (an unreachable hub or a missing dataset: one clear line)
        raise ValueError(f"{task}: cannot load {name} ({type(error).__name__}: {error})") from None


# ------------------------------------------------------------------------------------------ model
class HFModel:
    """Greedy/sampled generation and next-token choice scoring for a causal LM (plain prompts, no chat template;
    ``chat=True`` wraps each prompt as one user turn of the tokenizer's chat template)."""

    def __init__(self, model, tokenizer, batch_size: int = 8, chat: bool = False, seed: int = 0):
        self.model, self.tokenizer, self.batch_size, self.chat, self.seed = model, tokenizer, batch_size, chat, seed

    def _text(self, prompt: str) -> str:
        if not self.chat:
            return prompt
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], max_new_tokens: int, temperature: float = 0.0, stop: Optional[str] = None) -> list[str]:
        tok, side = self.tokenizer, self.tokenizer.padding_side
        tok.padding_side = "left"
        was = self.model.training
        self.model.eval()
        out = []
        merged = contextlib.ExitStack()
        try:
            merged.enter_context(merged_for_inference(self.model))  # (the adapters merged in place while generating, θ₀ restored after)
            if temperature > 0:
                torch.manual_seed(self.seed)  # (reproducible sampling)
            from tqdm.auto import tqdm

            for start in tqdm(range(0, len(prompts), self.batch_size), desc="generating", unit="batch", disable=None, leave=False):
                texts = [self._text(p) for p in prompts[start : start + self.batch_size]]
                enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not self.chat).to(self.model.device)
                kwargs = {"do_sample": True, "temperature": temperature, "top_p": 0.95} if temperature > 0 else {"do_sample": False}
                ids = self.model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, **kwargs)
                replies = tok.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                out += [r.split(stop)[0] if stop else r for r in replies]
        finally:
            merged.close()
            tok.padding_side = side
            self.model.train(was)
        return out

    @torch.no_grad()
    def choice_logprobs(self, prompt: str, options: Sequence[str]) -> list[float]:
        """log p(option's first token | prompt) for each option (MMLU's letters)."""
        enc = self.tokenizer(self._text(prompt), return_tensors="pt", add_special_tokens=not self.chat).to(self.model.device)
        logits = self.model(**enc).logits[0, -1].float().log_softmax(-1)
        ids = [self.tokenizer(o, add_special_tokens=False)["input_ids"][0] for o in options]
        return [float(logits[i]) for i in ids]


# ------------------------------------------------------------------------------------------ MMLU
LETTERS = ("A", "B", "C", "D")


def _mmlu_item(row: dict, with_answer: bool) -> str:
    text = row["question"].strip() + "\n" + "".join(f"{L}. {c}\n" for L, c in zip(LETTERS, row["choices"])) + "Answer:"
    return text + (f" {LETTERS[int(row['answer'])]}\n\n" if with_answer else "")


def mmlu(model, rows: Sequence[dict], dev: Sequence[dict], shots: int = 5) -> dict:
    """5-shot accuracy; ``rows``/``dev`` carry question, choices (4), answer (index) and subject."""
    by_subject = defaultdict(list)
    for r in dev:
        by_subject[r["subject"]].append(r)
    per = defaultdict(lambda: [0, 0])
    for row in rows:
        subject = row["subject"]
        head = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
        prompt = head + "".join(_mmlu_item(d, True) for d in by_subject[subject][:shots]) + _mmlu_item(row, False)
        scores = model.choice_logprobs(prompt, [f" {L}" for L in LETTERS])
        per[subject][0] += int(max(range(4), key=lambda i: scores[i]) == int(row["answer"]))
        per[subject][1] += 1
    correct, total = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
    return {"accuracy": correct / max(1, total), "total": total, "per_subject": {k: v[0] / v[1] for k, v in sorted(per.items())}}


# ------------------------------------------------------------------------------------------ GSM
NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def last_number(text: str) -> Optional[str]:
    found = NUMBER.findall(text)
    if not found:
        return None
    value = found[-1].replace(",", "").rstrip(".")
    return str(float(value)) if "." in value else str(int(value))


def gsm_reference(answer: str) -> str:
    return last_number(answer.split("####")[-1])


def gsm(model, rows: Sequence[dict], exemplars: Sequence[dict], shots: int = 8, limit: int = 200, max_new_tokens: int = 256) -> dict:
    """8-shot exact match of the last number; ``rows``/``exemplars`` carry question and answer (``… #### 42``)."""
    head = "".join(f"Question: {e['question']}\nAnswer: {e['answer'].split('####')[0].strip()} So the answer is {gsm_reference(e['answer'])}.\n\n" for e in exemplars[:shots])
    items = list(rows)[:limit]
    replies = model.generate([head + f"Question: {r['question']}\nAnswer:" for r in items], max_new_tokens, stop="\n\nQuestion:")
    hits = [last_number(reply) == gsm_reference(r["answer"]) for r, reply in zip(items, replies)]
    return {"exact_match": sum(hits) / max(1, len(hits)), "total": len(hits)}


# ------------------------------------------------------------------------------------------ BBH
def bbh_answer(reply: str) -> str:
    match = re.search(r"[Ss]o the answer is\s*(.+?)(?:\.\s*$|\.\n|\n|$)", reply.strip())
    text = match.group(1) if match else reply.strip().split("\n")[0]
    return text.strip().rstrip(".").strip()


def bbh(model, tasks: dict, shots: int = 3, per_task: int = 40, max_new_tokens: int = 128) -> dict:
    """3-shot exact match; ``tasks`` maps a task name to its rows (input, target); the first ``shots`` rows are the
    shots, the next ``per_task`` the test items."""
    per = {}
    for name, rows in sorted(tasks.items()):
        head = "".join(f"Q: {r['input']}\nA: So the answer is {r['target']}.\n\n" for r in rows[:shots])
        items = rows[shots : shots + per_task]
        replies = model.generate([head + f"Q: {r['input']}\nA:" for r in items], max_new_tokens, stop="\n\nQ:")
        per[name] = sum(bbh_answer(a) == r["target"].strip() for r, a in zip(items, replies)) / max(1, len(items))
    return {"exact_match": sum(per.values()) / max(1, len(per)), "per_task": per}


# ------------------------------------------------------------------------------------------ TyDiQA
def _normalize_answer(text: str) -> list[str]:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def f1(prediction: str, reference: str) -> float:
    """SQuAD token F1 (lower-case, no punctuation or articles)."""
    p, r = _normalize_answer(prediction), _normalize_answer(reference)
    common = Counter(p) & Counter(r)
    same = sum(common.values())
    if not p or not r:
        return float(p == r)
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(r)
    return 2 * precision * recall / (precision + recall)


def _language(row: dict) -> str:
    return row.get("language") or str(row.get("id", "unknown")).split("-")[0]


def tydiqa(model, rows: Sequence[dict], per_language: int = 100, shots: int = 1, max_new_tokens: int = 50) -> dict:
    """1-shot F1 (GoldP); rows carry context, question, answers ({'text': [...]}) and language (or an id
    ``<language>-…``). Each language's first ``shots`` rows are its shots."""
    by_language = defaultdict(list)
    for r in rows:
        by_language[_language(r)].append(r)

    def block(r, answer: Optional[str]):
        return f"Passage: {r['context']}\nQuestion: {r['question']}\nAnswer:" + (f" {answer}\n\n" if answer is not None else "")

    per = {}
    for lang, items in sorted(by_language.items()):
        head = "".join(block(r, r["answers"]["text"][0]) for r in items[:shots])
        test = items[shots : shots + per_language]
        replies = model.generate([head + block(r, None) for r in test], max_new_tokens, stop="\n")
        per[lang] = sum(max(f1(a, ref) for ref in r["answers"]["text"]) for r, a in zip(test, replies)) / max(1, len(test))
    return {"f1": sum(per.values()) / max(1, len(per)), "per_language": per}


# ------------------------------------------------------------------------------------------ HumanEval
CODE_EXECUTION_ENV = "HF_ALLOW_CODE_EVAL"  # (the variable evaluate's code_eval reads)
UNTRUSTED_RUNNER = Path(__file__).with_name("run_untrusted.py")  # (the child's guard, run as a script)


def check_code_execution_allowed(allow: bool = False) -> None:
    """Refuse to run model-written programs unless the user opted in: ``allow`` (``--allow-code-execution``) or
    ``HF_ALLOW_CODE_EVAL=1``, as ``evaluate``'s ``code_eval`` asks."""
    if allow or os.environ.get(CODE_EXECUTION_ENV) == "1":
        return
    raise ValueError(
        "humaneval runs the programs the model writes on this machine. Each runs in a separate process with time and "
        "memory limits and with process creation, file removal, os.system and network sockets disabled, but that is "
        "not a security boundary: run it where untrusted code may run (a container or virtual machine), and opt in "
        f"with --allow-code-execution (allow_code_execution=True in Python) or {CODE_EXECUTION_ENV}=1"
    )


def run_program(source: str, timeout: float = 10.0, memory_mb: int = 1024) -> bool:
    """Whether ``source`` runs to its end without an error or an early exit, in a separate isolated Python process
    (``-I``: no user site, no PYTHON* variables) in a fresh temporary directory, with CPU-time, memory and
    wall-clock limits, after process creation, file removal, os.system, network sockets and the like are disabled
    (``run_untrusted.py``). A safeguard against accidents, not a sandbox against an adversary."""

    def limits():  # (in the child, before exec)
        import resource

        resource.setrlimit(resource.RLIMIT_CPU, (int(timeout) + 1, int(timeout) + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
        os.setsid()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "program.py"
        path.write_text(source)
        try:
            done = subprocess.run([sys.executable, "-I", str(UNTRUSTED_RUNNER), str(path)], cwd=tmp, capture_output=True, timeout=timeout,
                                  env={"PATH": "/usr/bin:/bin"}, preexec_fn=limits if os.name == "posix" else None)  # fmt: skip
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def humaneval(model, rows: Sequence[dict], temperature: float = 0.1, max_new_tokens: int = 384, timeout: float = 10.0,
              runner: Callable[[str, float], bool] = run_program, allow_code_execution: bool = False) -> dict:  # fmt: skip
    """pass@1 with one sample per problem at ``temperature``; rows carry prompt, test and entry_point. Runs the
    model's programs: refused unless ``allow_code_execution`` or ``HF_ALLOW_CODE_EVAL=1``."""
    check_code_execution_allowed(allow_code_execution)
    completions = model.generate([r["prompt"] for r in rows], max_new_tokens, temperature=temperature, stop="\ndef ")
    passed = [runner(r["prompt"] + c + "\n\n" + r["test"] + f"\n\ncheck({r['entry_point']})\n", timeout) for r, c in zip(rows, completions)]
    return {"pass@1": sum(passed) / max(1, len(passed)), "total": len(passed)}


HEADLINE = {"mmlu": "accuracy", "gsm": "exact_match", "bbh": "exact_match", "tydiqa": "f1", "humaneval": "pass@1"}


def run_task(task: str, model: HFModel, rows: Sequence[dict], shots: Optional[Sequence[dict]] = None,
             allow_code_execution: bool = False) -> dict:  # fmt: skip
    """Score ``model`` on one task's ``rows`` (``shots``: MMLU dev items / GSM exemplars); the result has the task's
    metrics plus ``"score"``, its headline number (App. E.1). ``allow_code_execution``: see :func:`humaneval`."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; the suite has {list(TASKS)}")
    if task in SHOT_SPLITS and shots is None:
        raise ValueError(f"{task} needs its few-shot items (shots=...)")
    if task == "mmlu":
        result = mmlu(model, rows, shots)
    elif task == "gsm":
        result = gsm(model, rows, shots)
    elif task == "bbh":
        tasks: dict = {}
        for row in rows:
            if "task" not in row:
                raise ValueError("bbh rows need a 'task' field naming their BBH task (one JSONL for all 23 tasks)")
            tasks.setdefault(row["task"], []).append(row)
        result = bbh(model, tasks)
    elif task == "tydiqa":
        result = tydiqa(model, rows)
    else:
        result = humaneval(model, rows, allow_code_execution=allow_code_execution)
    return {**result, "score": result[HEADLINE[task]]}
