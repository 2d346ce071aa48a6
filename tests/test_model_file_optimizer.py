"""A model file's build_optimizer that raises is one line naming the file and line, in probe as in train (#53)."""
from autofit.errors import UserError

import pytest

from autofit.spec import load_spec

MODEL_FILE = '''
import torch
from torch import nn


def build_model():
    return nn.Linear(4, 2)


def example_batch(n):
    return torch.randn(n, 4), torch.randint(0, 2, (n,))


def build_optimizer(params):
    raise ValueError("no optimizer today")
'''


def test_a_build_optimizer_that_raises_is_one_line(tmp_path):
    """``probe``, ``plan`` and ``train`` all build the optimizer through the spec, which is where it is checked."""
    path = tmp_path / "bad_optimizer.py"
    path.write_text(MODEL_FILE)
    spec = load_spec(str(path))
    with pytest.raises(UserError, match=r"build_optimizer\(params\) raised ValueError: no optimizer today \(bad_optimizer.py, line 15\)"):
        spec.build_optimizer(spec.build_model().parameters())
