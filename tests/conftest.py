import gc
import sys
import pytest
import torch

# One intra-op thread for the whole session: on a shared two-core machine a second thread spins
# against other jobs (a ResNet-18 probe took 5-17 s of CPU with two threads, 1 s with one).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    _longest_modules_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


LONGEST_MODULES = [
    "training/test_train_distributed.py", "test_every_model.py", "test_gpu_truth.py", "planning/test_planner_gpus.py",
    "planning/memory/test_repeats.py", "planning/test_plan_levers.py", "planning/test_capacity.py",
    "planning/test_capacity_lengths.py", "planning/test_plan_search_levers.py",
    "training/test_lora.py", "strategies/test_frozen_nf4.py", "training/test_faults.py", "strategies/test_compile.py",
    "planning/memory/test_trace_pool.py", "planning/memory/test_trace_deadlines.py", "planning/memory/test_memory_grid.py",
    "planning/test_planner.py",
]
"""The modules that took longest in the last durations table (bench/RESULTS.md, "Test suite"), longest first."""


def _longest_modules_first(items) -> None:
    """``LONGEST_MODULES`` first, then the rest in file order, each module's tests together and in order:
    pytest-xdist's loadscope hands modules out in this order, so the long ones start early and the short ones fill
    the cores at the end (in file order a module of a minute and a half was among the last ones left)."""
    first = {name: rank for rank, name in enumerate(LONGEST_MODULES)}

    def rank(item) -> int:
        path = item.path.as_posix()
        return next((r for name, r in first.items() if path.endswith("tests/" + name)), len(first))

    items.sort(key=rank)


@pytest.fixture(autouse=True, scope="session")
def suite_environment(tmp_path_factory):
    """The suite's planning environment, for this process and the commands it starts:

    - plans keep their costs in a temporary cache, never the user's (~/.cache/autofit);
    - the short timing policy (``AUTOFIT_TIMING=short``): the memory figures are the same, and the modules that test
      timing itself take the ``full_timing`` fixture;
    - no trace workers (``AUTOFIT_TRACE_WORKERS=0``): pytest-xdist already gives each core a test, so a pool would
      only add processes; the pool's own tests set the variable.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path_factory.mktemp("autofit-cache")))
        patch.setenv("AUTOFIT_TIMING", "short")
        patch.setenv("AUTOFIT_TRACE_WORKERS", "0")
        yield


@pytest.fixture
def full_timing(monkeypatch):
    """The production timing policy, for a test of timing itself."""
    monkeypatch.setenv("AUTOFIT_TIMING", "full")


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared two-core machine two threads spin against other jobs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def quiet_process():
    """For a module of many probes: one intra-op thread, and a garbage collector that skips the objects made before
    (each probe collects)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A model file, an image folder and a plan for them (``tests/helpers/images.py``)."""
    from tests.helpers.images import make_project

    return make_project(tmp_path_factory.mktemp("project"))


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


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory):
    """A folder with a tiny Llama-style model and its tokenizer (``tests/helpers/tiny_lm.py``), made once per session:
    read it, never write into it; skipped without transformers."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tests.helpers.tiny_lm import tiny_lm_dir

    return tiny_lm_dir(tmp_path_factory.mktemp("tiny-lm"))


@pytest.fixture(scope="session")
def tiny_lm_long(tmp_path_factory):
    """``tiny_lm``'s model with a context of 65,536 tokens, its config alone (no weights, no tokenizer saved): a card's
    longest sequence then lies far inside it. Read it, never write into it; skipped without transformers."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tests.helpers.tiny_lm import tiny_lm_dir

    return tiny_lm_dir(tmp_path_factory.mktemp("tiny-lm-long"), tokenizer=False, weights=False, context=65536)
