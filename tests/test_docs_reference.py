"""docs/trainer.md's reference documents every key of the config model (issue 35 item 7: distributed.decode was
missing): a key is documented when the reference names it in backticks, or its section's own table row names the
key's last part (``model.lora``'s row lists ``r``, ``alpha``, ...)."""
from __future__ import annotations

import typing
from pathlib import Path

from pydantic import BaseModel

from opdistill.train.run.config import TrainerConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "trainer.md"


def _section(annotation) -> type[BaseModel] | None:
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def config_keys(model: type[BaseModel] = TrainerConfig, prefix: str = "") -> list[str]:
    """Every leaf key of the config model, dotted (a section that may be null counts by its keys)."""
    keys = []
    for name, field in model.model_fields.items():
        sub = _section(field.annotation)
        keys += config_keys(sub, f"{prefix}{name}.") if sub is not None else [prefix + name]
    return keys


def undocumented(doc: str) -> list[str]:
    rows = [line for line in doc.splitlines() if line.startswith("| `")]
    missing = []
    for key in config_keys():
        parent, _, leaf = key.rpartition(".")
        if f"`{key}`" in doc:
            continue
        if parent and any(row.startswith(f"| `{parent}` |") and leaf in row for row in rows):
            continue
        missing.append(key)
    return missing


def test_every_config_key_is_in_the_reference():
    assert len(config_keys()) > 100  # the walk reaches the nested sections
    assert undocumented(DOC.read_text()) == []


def test_a_key_left_out_of_the_reference_fails():
    doc = DOC.read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `distributed.decode` |"))
    assert undocumented(doc.replace(row, "")) == ["distributed.decode"]
