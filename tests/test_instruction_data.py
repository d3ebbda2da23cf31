"""Instruction data: formats, assistant-only labels, reported lengths, clear errors."""

import json

import pytest

from peft_sparse.data.instructions import TULU_TEMPLATE, as_messages, load_instruction_data, tokenize_chat, tokenize_chats

from .models import tiny_tokenizer


def _tok(template=True):
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ 't3 ' if m['role'] == 'user' else 't4 ' }}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}t4 {% endif %}"
    ) if template else None  # fmt: skip
    return tok


def test_labels_cover_the_assistant_turns_only():
    tok = _tok()
    chat = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7"},
            {"role": "user", "content": "t5"}, {"role": "assistant", "content": "t8 t9"}]  # fmt: skip
    ids, labels = tokenize_chat(tok, chat)
    words = tok.convert_ids_to_tokens(ids)
    assert words == ["t3", "t5", "t6", "t4", "t7", "t3", "t5", "t4", "t8", "t9"]
    trained = [w for w, label in zip(words, labels) if label != -100]
    assert trained == ["t7", "t8", "t9"]


def test_tulu_format_without_a_chat_template():
    from transformers import PreTrainedTokenizerFast

    tok = _tok(template=False)
    assert not tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tokenize=False,
                                   chat_template=TULU_TEMPLATE)  # fmt: skip
    assert text == "<|user|>\nhi\n<|assistant|>\nyo" + tok.eos_token + "\n"
    assert isinstance(tok, PreTrainedTokenizerFast)


def test_prompt_completion_rows_become_chats_and_long_examples_are_counted():
    tok = _tok()
    rows = [{"prompt": "t5", "completion": "t7"}, {"prompt": "t5 " * 20, "completion": "t7"}, {"prompt": "t5", "completion": "t7 " * 20}]
    assert as_messages(rows[0]) == [{"role": "user", "content": "t5"}, {"role": "assistant", "content": "t7"}]
    examples, report = tokenize_chats(tok, rows, max_length=8)
    assert report == {"kept": 1, "too_long": 1, "prompt_too_long": 1}
    assert len(examples) == 1


def test_local_files_and_bad_rows(tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]))
    assert len(load_instruction_data(path)) == 1
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "completion": "b"}]), tmp_path / "d.parquet")
    assert load_instruction_data(tmp_path / "d.parquet")[0]["completion"] == "b"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"instruction": "a", "output": "b"}))
    with pytest.raises(ValueError, match=r"bad.jsonl\[0\]: expected field 'messages'.*got fields \['instruction', 'output'\]"):
        load_instruction_data(bad)
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}]}))
    with pytest.raises(ValueError, match="has no assistant turn"):
        load_instruction_data(bad)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="hub is switched off"):
        load_instruction_data("allenai/tulu-v2-sft-mixture")
