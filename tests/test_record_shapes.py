"""The path of a call from the event loop to the store holds few data shapes, and no shape that only
copies another: one record (``CallRecord``, with its ``Call``) is made on the loop, enriched by the
pipeline and mapped to the steps row in one place (``recording.step_row``).

The record shapes defined in ``addon/`` and ``stepmill/pipeline/`` (dataclasses, NamedTuples, TypedDicts)
are these 5, and this test fails when one more appears:

- ``addon/engine.py`` ``Added``: the id fields stepmill added to an engine request (to take out of its answer);
- ``addon/loop_state.py`` ``Capture``: a call in flight on the loop (its record, protocol, request bytes, tap);
- ``stepmill/pipeline/call_record.py`` ``Call`` and ``CallRecord``: who made the call, and the record itself;
- ``stepmill/pipeline/journal.py`` ``Position``: where in the journal the writer committed.

(Before they were 6: a WebSocket turn had a ``Turn`` of its own, copied into a ``CallRecord`` when it ended.)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent
FOLDERS = ("addon", "stepmill/pipeline")
LIMIT = 5
SHAPE_BASES = {"NamedTuple", "TypedDict"}


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def shapes_in(source: str) -> list[str]:
    """The classes of ``source`` that are data shapes: dataclasses (called or not), NamedTuples, TypedDicts."""
    return [node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef) and (
        any(_name(d) == "dataclass" for d in node.decorator_list) or any(_name(b) in SHAPE_BASES for b in node.bases))]


def record_shapes() -> list[str]:
    return [f"{path.relative_to(ROOT)}:{name}" for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
            for name in shapes_in(path.read_text())]


def test_the_record_shapes_on_the_path_do_not_grow():
    shapes = record_shapes()
    assert len(shapes) <= LIMIT, f"{len(shapes)} record shapes on the path, at most {LIMIT}: {shapes}"


def test_the_count_sees_every_kind_of_shape():
    source = ("from dataclasses import dataclass\nimport typing\n@dataclass\nclass A: x: int\n"
              "@dataclass(frozen=True)\nclass B: x: int\nclass C(typing.NamedTuple): x: int\n"
              "class D(typing.TypedDict): x: int\nclass E: pass\n")
    assert shapes_in(source) == ["A", "B", "C", "D"]
    assert sorted(record_shapes()) == ["addon/engine.py:Added", "addon/loop_state.py:Capture",
                                       "stepmill/pipeline/call_record.py:Call",
                                       "stepmill/pipeline/call_record.py:CallRecord",
                                       "stepmill/pipeline/journal.py:Position"]
