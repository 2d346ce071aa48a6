"""PlanPolicy and TimingPolicy: every threshold says why it is what it is, and the planner's policy cannot be changed under it."""
import ast
import dataclasses
import inspect

import pytest

from autofit.planning import policy
from autofit.errors import UserError
from autofit.planning.policy import POLICY, TIMING_POLICIES, TIMING_VARIABLE, PlanPolicy, TimingPolicy, timing_policy


def _field_docstrings(name: str) -> dict[str, str | None]:
    """Each annotated field of the class ``name``, with the string literal right under it (None where there is none)."""
    (cls,) = [n for n in ast.parse(inspect.getsource(policy)).body if isinstance(n, ast.ClassDef) and n.name == name]
    found = {}
    for statement, following in zip(cls.body, cls.body[1:] + [None]):
        if isinstance(statement, ast.AnnAssign):
            is_doc = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)
            found[statement.target.id] = following.value.value if is_doc else None
    return found


@pytest.mark.parametrize("cls", [PlanPolicy, TimingPolicy])
def test_every_field_has_a_docstring(cls):
    docs = _field_docstrings(cls.__name__)
    assert set(docs) == {f.name for f in dataclasses.fields(cls)}
    assert [name for name, doc in docs.items() if not (doc and doc.strip())] == []


def test_the_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        timing_policy().min_rounds = 3
    assert POLICY == PlanPolicy()


def test_the_timing_policy_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(TIMING_VARIABLE, raising=False)
    assert timing_policy() == TimingPolicy()
    monkeypatch.setenv(TIMING_VARIABLE, "short")
    short = timing_policy()
    assert short == TIMING_POLICIES["short"] and short.max_rounds < TimingPolicy().max_rounds
    assert short.min_rounds <= short.max_rounds <= short.max_noisy_rounds
    monkeypatch.setenv(TIMING_VARIABLE, "quick")
    with pytest.raises(UserError, match="AUTOFIT_TIMING='quick' names no timing policy: use one of full, short"):
        timing_policy()
