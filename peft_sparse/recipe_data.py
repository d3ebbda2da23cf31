"""A recipe's training and evaluation rows: a local JSONL file, a bundled or cached instruction dataset, or
``hub:NAME``; optionally one subset of a mixture."""

from __future__ import annotations

import json
from typing import Optional

HUB = "hub:"


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_rows(source, limit: Optional[int] = None, subset: Optional[str] = None) -> list[dict]:
    """A recipe's data: a local file, or ``hub:NAME`` (``peft_sparse.data.load_instruction_data``); with ``subset``,
    only the rows whose ``dataset`` field is that name (the Tulu v2 mixture names each row's source)."""
    from .data.instructions import load_instruction_data

    if isinstance(source, str) and source.startswith(HUB):
        rows = load_instruction_data(source[len(HUB) :])
    else:
        rows = read_jsonl(source) if str(source).endswith(".jsonl") else load_instruction_data(source)
    if subset is not None:
        names = sorted({str(r["dataset"]) for r in rows if r.get("dataset") is not None})
        unnamed = sum(1 for r in rows if r.get("dataset") is None)
        chosen = [r for r in rows if r.get("dataset") == subset]
        if not chosen:
            if not names:
                raise ValueError(
                    f"recipe data.subset={subset!r} matches no row of {source}: none of its {len(rows)} rows has a "
                    "'dataset' field naming its subset (leave data.subset out to train on them all)"
                )
            more = f" ({len(names) - 20} more)" if len(names) > 20 else ""
            without = f"; {unnamed} rows have no 'dataset' field" if unnamed else ""
            raise ValueError(f"recipe data.subset={subset!r} matches no row of {source}; its rows name the subsets {names[:20]}{more}{without}")
        rows = chosen
    return rows[:limit] if limit is not None else rows
