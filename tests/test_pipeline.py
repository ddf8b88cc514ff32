"""The pipelines (ptckpt.pipeline): a restore as named stages, each short, each undone by
the run's undo stack when a later one fails (tests/test_restore_interrupt.py interrupts a
real restore at its stages; here the stack itself and the shape of the stages)."""

from __future__ import annotations

import ast
import inspect

import pytest

from ptckpt.pipeline import Undo
from ptckpt.pipeline import dump as dump_pipeline
from ptckpt.pipeline import restore as restore_pipeline

STAGES = {restore_pipeline: ("restore", ("collect", "plan", "open_sources", "create", "rebuild", "hand_off",
                                         "resume")),
          dump_pipeline: ("dump", ("check", "freeze", "capture", "write", "commit", "release"))}


def test_the_undo_stack_runs_only_on_failure_last_first():
    done = []
    with Undo() as undo:
        undo.on_failure(done.append, "first")
        undo.on_failure(done.append, "second")
    assert done == [], "a run that ends well undoes nothing"
    with pytest.raises(RuntimeError, match="stage failed"):
        with Undo() as undo:
            undo.on_failure(done.append, "first")
            undo.on_failure(lambda: 1 / 0)           # an undo that fails does not hide the failure
            undo.on_failure(done.append, "second")
            raise RuntimeError("stage failed")
    assert done == ["second", "first"]


@pytest.mark.parametrize("module", list(STAGES), ids=lambda m: m.__name__)
def test_every_stage_is_a_short_function(module):
    entry, stages = STAGES[module]
    tree = ast.parse(inspect.getsource(module))
    lengths = {f.name: f.end_lineno - f.lineno + 1 for f in tree.body if isinstance(f, ast.FunctionDef)}
    assert set(stages) <= set(lengths)
    long = {name: n for name, n in lengths.items() if n > 60 and name != entry}
    assert not long, f"functions of the pipeline over 60 lines: {long}"
    body = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == entry)
    code = body.end_lineno - body.lineno + 1 - len(ast.get_docstring(body).splitlines())
    assert code <= 30, f"{entry}() runs the stages; the work is theirs"
