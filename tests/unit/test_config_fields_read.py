"""Proves that the config has no knob that lies: every field of every section (walked from the
root `Config`, by dotted path) is read somewhere in asyncrl's code outside the config package
itself (the schema validating or deriving from a field is not a use); and that the check fails on
a planted field nobody reads.

The check is static, over the source: a field counts as read when its name appears as an
attribute access (`cfg.rollout.n`), a string subscript or lookup (`d["n"]`, `d.get("n")`), or a
`getattr`/`hasattr` string anywhere under asyncrl/ outside asyncrl/config/. Sections that cross a
process boundary as JSON (`model_dump_json` -> `model_validate_json`) are read by attribute on the
other side, so they need no special case. A name shared by two fields is satisfied by either: the
check catches a knob nothing reads under any name, which is how the known liars looked.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, Field

from asyncrl.config import Config, DataConfig

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "asyncrl"
CONFIG_PACKAGE = PACKAGE / "config"


def _submodel(annotation: object) -> type[BaseModel] | None:
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def schema_fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted path, field name) of every leaf and section field under `model`."""
    for name, field in model.model_fields.items():
        yield prefix + name, name
        sub = _submodel(field.annotation)
        if sub is not None:
            yield from schema_fields(sub, f"{prefix}{name}.")


def names_read(root: Path = PACKAGE, exclude: Path = CONFIG_PACKAGE) -> set[str]:
    """Every name the source under `root` (outside `exclude`) reads as an attribute, a string
    subscript, a `.get`/`.pop`/`.setdefault` string key, or a `getattr`/`hasattr` string."""
    names: set[str] = set()
    for path in sorted(root.rglob("*.py")):
        if exclude in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                if isinstance(node.slice.value, str):
                    names.add(node.slice.value)
            elif isinstance(node, ast.Call) and len(node.args) >= 1:
                func = node.func
                key_arg = None
                if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(node.args) >= 2:
                    key_arg = node.args[1]
                elif isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault"):
                    key_arg = node.args[0]
                if isinstance(key_arg, ast.Constant) and isinstance(key_arg.value, str):
                    names.add(key_arg.value)
    return names


def unread_fields(model: type[BaseModel] = Config, read: set[str] | None = None) -> list[str]:
    """Dotted paths of the fields of `model` whose name no code reads."""
    read = names_read() if read is None else read
    return [path for path, name in schema_fields(model) if name not in read]


def test_every_config_field_is_read_by_the_code() -> None:
    unread = unread_fields()
    assert unread == [], f"config fields no code under asyncrl/ reads (wire them or remove them): {unread}"


def test_the_check_fails_on_a_planted_unused_field() -> None:
    class PlantedData(DataConfig):
        knob_nobody_reads_zq: int = 3
        """A planted knob."""

    class PlantedConfig(Config):
        data: PlantedData = Field(default_factory=PlantedData)

    read = names_read()
    assert unread_fields(PlantedConfig, read) == ["data.knob_nobody_reads_zq"]
    assert unread_fields(Config, read) == []


def test_the_walk_covers_nested_sections() -> None:
    paths = {path for path, _ in schema_fields(Config)}
    assert {"rollout.guide.sampling.max_tokens", "learner.kl.coef", "buffer.durable.fsync",
            "verifier.autoscaling.min_replicas", "trainer.logger"} <= paths
