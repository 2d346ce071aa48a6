"""The docs run as pasted: every ```python block of README.md and docs/*.md executes on its own.

Each block runs in a fresh namespace in a temporary folder (what it writes,
plan.json or runs/, stays there), so a block must import and define every name
it uses. Blocks are kept small (tiny models, simulated or CPU plans, a few
steps): what cannot run quickly belongs in examples/, run by a test, or in a
```bash block.
"""
import re
import runpy
import sys

import pytest

from tests.helpers import EXAMPLES, ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _python_blocks():
    for path in DOCS:
        text = path.read_text()
        for match in PYTHON_BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            yield pytest.param(path, line, match.group(1), id=f"{path.relative_to(ROOT)}:{line}")


BLOCKS = list(_python_blocks())


def test_the_docs_hold_python_blocks():
    # The pattern finds them: a change of fence style would otherwise let every snippet go untested.
    assert len(BLOCKS) >= 8 and (ROOT / "docs").is_dir()


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
@pytest.mark.parametrize(("path", "line", "code"), BLOCKS)
def test_python_block_runs_as_pasted(path, line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # The line numbers of a traceback are the block's own; its file name says where the block is.
    padded = "\n" * (line) + code
    exec(compile(padded, f"{path.relative_to(ROOT)}", "exec"), {"__name__": "__docs__"})


def test_own_loop_example_trains_a_plan_written_by_hand(tmp_path, monkeypatch, capsys):
    """docs/multi-gpu.md's script, on one process (tests/training/test_train_distributed.py runs two through torchrun)."""
    import autofit

    plan_path = tmp_path / "plan.json"
    autofit.save_plan(autofit.Plan(budget_bytes=2**30, config=autofit.TrainingConfig(global_batch_size=8, micro_batch_size=2)), plan_path)
    monkeypatch.setattr(sys, "argv", ["own_loop.py", str(plan_path), "--steps", "2"])
    runpy.run_path(str(EXAMPLES / "own_loop.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[-1].startswith("step 2: rank 0 of 1") and "4 micro-batch(es) of 2" in lines[-1]


def test_make_tiny_llm_makes_what_finetune_md_starts_from(tmp_path, monkeypatch, capsys):
    """docs/finetune.md begins with examples/make_tiny_llm.py: an hf:DIR folder and a text file, made offline."""
    pytest.importorskip("transformers")
    import autofit

    model_dir, text = tmp_path / "models" / "tiny-llama", tmp_path / "corpus.txt"
    monkeypatch.setattr(sys, "argv", ["make_tiny_llm.py", str(model_dir), str(text)])
    runpy.run_path(str(EXAMPLES / "make_tiny_llm.py"), run_name="__main__")
    assert capsys.readouterr().out.startswith(f"wrote {model_dir}")
    spec = autofit.load_spec(f"hf:{model_dir}", task="causal-lm", seq_len=16)
    inputs, _ = spec.example_batch(2)
    assert inputs["input_ids"].shape == (2, 16)
    assert spec.build_pretrained is not None  # the weights are there: train starts from them
    assert text.read_text().count("\n\n") >= 50  # documents, one a paragraph


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(path):
    missing = [
        target for target in LINK.findall(path.read_text())
        if "://" not in target and not (path.parent / target).exists()
    ]
    assert missing == []


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_ci_runs_the_readme_s_test_command():
    """CI runs what the README tells a developer to run, verbatim (one command)."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"^## Tests\n\n```bash\n(.+)\n```", readme, re.MULTILINE).group(1)
    assert (ROOT / ".ci" / "run").read_text().rstrip().splitlines()[-1] == command
