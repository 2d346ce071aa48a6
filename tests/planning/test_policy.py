"""PlanPolicy: every threshold says why it is what it is, and the planner's policy cannot be changed under it."""
import ast
import dataclasses
import inspect

import pytest

from autofit.planning import policy
from autofit.planning.policy import POLICY, PlanPolicy


def _field_docstrings() -> dict[str, str | None]:
    """Each annotated field of PlanPolicy, with the string literal right under it (None where there is none)."""
    (cls,) = [n for n in ast.parse(inspect.getsource(policy)).body if isinstance(n, ast.ClassDef) and n.name == "PlanPolicy"]
    found = {}
    for statement, following in zip(cls.body, cls.body[1:] + [None]):
        if isinstance(statement, ast.AnnAssign):
            is_doc = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)
            found[statement.target.id] = following.value.value if is_doc else None
    return found


def test_every_field_has_a_docstring():
    docs = _field_docstrings()
    assert set(docs) == {f.name for f in dataclasses.fields(PlanPolicy)}
    assert [name for name, doc in docs.items() if not (doc and doc.strip())] == []


def test_the_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        POLICY.min_rounds = 3
    assert POLICY == PlanPolicy()
