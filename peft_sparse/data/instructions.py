"""Instruction data: local JSONL/JSON/Parquet or hub datasets, chat or prompt/completion rows, and tokenized
examples whose loss covers the assistant turns only.

Rows hold either ``messages`` (a chat: ``[{"role": ..., "content": ...}, ...]`` with at least one assistant
turn) or ``prompt`` and ``completion`` (strings, or message lists as TRL's conversational format). A chat is
rendered with the tokenizer's chat template, or with the Tulu format (``<|user|>\\n…\\n<|assistant|>\\n…``, as
Tulu v2 trains Llama-2) when the tokenizer has none. Examples longer than ``max_length`` are not silently cut:
:func:`tokenize_chats` drops them and reports how many (and why).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

TULU_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}<|system|>\n{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}<|user|>\n{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def load_instruction_data(source: Union[str, os.PathLike], split: str = "train", limit: Optional[int] = None) -> list[dict]:
    """Rows of a local ``.jsonl``/``.json``/``.parquet`` file, or of a hub dataset by name (online only)."""
    path = Path(source)
    if path.suffix in (".jsonl", ".json", ".parquet") or path.exists():
        if not path.is_file():
            raise ValueError(f"data source={str(source)!r} does not exist")
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        elif path.suffix == ".json":
            rows = json.loads(path.read_text())
        else:
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
    else:
        if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
            raise ValueError(f"data source={str(source)!r} is a hub dataset, but the hub is switched off here (HF_HUB_OFFLINE); use a local file")
        from datasets import load_dataset

        try:
            rows = list(load_dataset(str(source), split=split))
        except Exception as error:  # noqa: BLE001  (an unreachable hub, a missing dataset: one clear line)
            raise ValueError(f"data source={str(source)!r}: cannot load it from the hub ({type(error).__name__}: {error})") from None
    rows = rows[:limit] if limit is not None else rows
    for i, row in enumerate(rows):
        check_row(row, f"{source}[{i}]")
    return rows


def check_row(row: dict, where: str) -> None:
    """A clear error naming the row and field when it is neither a chat nor a prompt/completion pair."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a mapping, got {type(row).__name__}")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError(f"{where}: field 'messages' must be a list of {{'role', 'content'}} mappings")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: the chat in field 'messages' has no assistant turn to train on")
        return
    if "prompt" in row and "completion" in row:
        return
    raise ValueError(f"{where}: expected field 'messages' (a chat) or fields 'prompt' and 'completion', got fields {sorted(row)}")


def as_messages(row: dict) -> list:
    """The row as one chat."""
    if "messages" in row:
        return row["messages"]
    prompt, completion = row["prompt"], row["completion"]
    prompt = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    completion = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
    return prompt + completion


def _render(tokenizer, messages, generation_prompt: bool) -> list[int]:
    template = None if getattr(tokenizer, "chat_template", None) else TULU_TEMPLATE
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, chat_template=template)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_chat(tokenizer, messages: list) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a whole chat; labels are -100 outside the assistant turns' tokens."""
    ids = _render(tokenizer, messages, False)
    labels = [-100] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], True))  # the chat so far, with the assistant header
        end = len(_render(tokenizer, messages[: i + 1], False))
        if ids[:end] != _render(tokenizer, messages[: i + 1], False):
            raise ValueError("the chat template does not render a chat as the concatenation of its turns; assistant tokens cannot be located")
        labels[start:end] = ids[start:end]
    return ids, labels


def tokenize_chats(tokenizer, rows: list[dict], max_length: int) -> tuple[list[tuple], dict]:
    """Tokenized examples of ``rows`` and a report: examples longer than ``max_length`` are dropped and counted
    (``too_long``), as are those whose prompt alone exceeds it (``prompt_too_long``); nothing is cut silently."""
    out, report = [], {"kept": 0, "too_long": 0, "prompt_too_long": 0}
    for row in rows:
        ids, labels = tokenize_chat(tokenizer, as_messages(row))
        if len(ids) > max_length:
            first = next((i for i, label in enumerate(labels) if label != -100), len(ids))
            report["prompt_too_long" if first >= max_length else "too_long"] += 1
            continue
        out.append((ids, labels))
        report["kept"] += 1
    return out, report
