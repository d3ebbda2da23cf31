"""Saved SpIEL adapters whose config holds a field that has since been removed keep loading when that field held the
value the remaining behaviour corresponds to (its old default), and are refused, naming the field, when it asked for
the behaviour that is gone."""

import json
import warnings

import pytest
import torch
from peft import PeftConfig, PeftModel, get_peft_model

from peft_sparse import SpIELConfig

from .models import inputs, sparse_layers, tiny_llama

# (field, growth, a value that loads, a value that is refused)
CASES = [
    ("replacement_rounding", "ag", "per_tensor", "apportioned"),
    ("grow_init", "ag", "zero", "gradient"),
    ("seed_moments", "ag", "second", "both"),
    ("seed_moments", "ag", None, "none"),
    ("seed_moments", "ma", "none", "second"),
    ("column_cap", "ma", None, 2.0),
    ("ma_unseen", "ma", "zero", "mean"),
    ("ma_regrow_dropped", "ma", True, False),
]


def _saved(tmp_path, growth: str, **extra) -> tuple:
    """A saved adapter directory whose adapter_config.json also holds ``extra`` (as a config saved before the
    fields were removed does), and the model it was saved from."""
    model = get_peft_model(tiny_llama(), SpIELConfig(target_modules="all-linear", density=0.1, growth=growth, init_weights=False))
    model.save_pretrained(tmp_path)
    path = tmp_path / "adapter_config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, **extra}))
    return tmp_path, model, saved


@pytest.mark.parametrize("field,growth,loads,refused", CASES)
def test_a_removed_field_at_its_old_default_loads_as_the_remaining_behaviour(field, growth, loads, refused, tmp_path):
    path, model, clean = _saved(tmp_path, growth, **{field: loads})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (no "Unexpected keyword arguments … ignored" from PEFT)
        config = PeftConfig.from_pretrained(path)
    assert isinstance(config, SpIELConfig) and not hasattr(config, field)
    assert json.loads(json.dumps(config.to_dict(), default=sorted)) == {**clean, "target_modules": sorted(clean["target_modules"])}
    loaded = PeftModel.from_pretrained(tiny_llama(), path)
    x = inputs()
    torch.testing.assert_close(loaded(x).logits, model(x).logits)
    for a, b in zip(sparse_layers(loaded), sparse_layers(model)):
        assert torch.equal(a.sparse_indices["default"], b.sparse_indices["default"])


@pytest.mark.parametrize("field,growth,loads,refused", CASES)
def test_a_removed_field_asking_for_the_removed_behaviour_is_refused_by_name(field, growth, loads, refused, tmp_path):
    path, _, _ = _saved(tmp_path, growth, **{field: refused})
    with pytest.raises(ValueError, match=f"SpIELConfig has no field {field} any more, and {field}={refused!r}"):
        PeftConfig.from_pretrained(path)
    with pytest.raises(ValueError, match=f"no field {field}"):
        PeftModel.from_pretrained(tiny_llama(), path)
    with pytest.raises(ValueError, match=f"no field {field}"):  # (and given to the constructor directly)
        SpIELConfig(target_modules="all-linear", density=0.1, growth=growth, **{field: refused})


def test_the_regrowth_rule_points_to_the_authors_reference():
    with pytest.raises(ValueError, match="reference='authors'"):
        SpIELConfig(target_modules="all-linear", density=0.1, growth="ma", ma_regrow_dropped=False)


def test_removed_fields_are_listed_and_not_in_the_saved_config():
    assert set(SpIELConfig.removed_fields) == {"replacement_rounding", "grow_init", "seed_moments", "column_cap", "ma_unseen", "ma_regrow_dropped"}
    saved = SpIELConfig(target_modules="all-linear", density=0.1).to_dict()
    assert not set(SpIELConfig.removed_fields) & set(saved)


def test_the_configuration_reference_documents_every_field_and_no_removed_one():
    """docs/configuration.md has a table row for every field of SpIELConfig and LTSFTConfig (PEFT's own fields aside)
    and none for a removed field; docs/ablations.md has a row with the measurements of each removed field."""
    import dataclasses
    import re
    from pathlib import Path

    from peft.config import PeftConfig as PeftBase

    from peft_sparse import LTSFTConfig

    docs = Path(__file__).resolve().parents[1] / "docs"
    rows = [line for line in (docs / "configuration.md").read_text().splitlines() if line.startswith("| ")]
    in_rows = {name for line in rows for name in re.findall(r"`([a-z_0-9]+)`", line.split("|")[3])}
    peft_fields = {f.name for f in dataclasses.fields(PeftBase)}
    for cls in (SpIELConfig, LTSFTConfig):
        fields = {f.name for f in dataclasses.fields(cls)} - peft_fields
        assert fields <= in_rows, (cls.__name__, sorted(fields - in_rows))
    assert not set(SpIELConfig.removed_fields) & in_rows
    ablation_rows = [line.split("|")[1].strip() for line in (docs / "ablations.md").read_text().splitlines() if line.startswith("| `")]
    assert {name.strip("`") for name in ablation_rows} >= set(SpIELConfig.removed_fields)
