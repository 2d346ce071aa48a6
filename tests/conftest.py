import gc
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# One intra-op thread for the whole session: on a shared two-core machine a second thread spins
# against other jobs (a ResNet-18 probe took 5-17 s of CPU with two threads, 1 s with one).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def private_plan_cache(tmp_path_factory):
    """Plans made by the tests keep their costs in a temporary cache, never the user's (~/.cache/autofit)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path_factory.mktemp("autofit-cache")))
        yield


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared two-core machine two threads spin against other jobs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """Run `autofit ARGS` in this process; returns (exit_code, stdout, stderr)."""
    from autofit.cli import main

    def run(*args: str):
        monkeypatch.setattr(sys, "argv", ["autofit", *map(str, args)])
        try:
            main()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@pytest.fixture(autouse=True)
def frozen_heap():
    """Objects alive when a test starts (torch, the libraries, the tests' modules) are left out of garbage collections.

    Probes and the planner call gc.collect() between measurements; scanning the
    half-million objects the imports made took about 0.5 s a call, half of a
    small plan's time. What a test makes is collected as before.
    """
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture
def tiny_lm(tmp_path):
    """A folder with a tiny Llama-style model and its tokenizer (``tests/tiny_lm.py``); skipped without transformers."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tests.tiny_lm import tiny_lm_dir

    return tiny_lm_dir(tmp_path / "tiny-lm")
