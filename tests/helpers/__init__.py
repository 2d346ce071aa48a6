"""What several test modules share: paths, models, model files and runs (no test module imports another)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root."""
EXAMPLES = ROOT / "examples"
"""The bundled example model files and data recipes."""


def main_exit_code(*args) -> int:
    """`autofit ARGS` run in this process (one interpreter start less than a subprocess; a module fixture cannot take
    the function-scoped ``run_cli``): the exit code ``autofit.cli.main`` ends with."""
    import sys

    from autofit.cli import main

    argv = sys.argv
    sys.argv = ["autofit", *map(str, args)]
    try:
        main()
    except SystemExit as exit_:
        return exit_.code
    finally:
        sys.argv = argv
    raise AssertionError("autofit.cli.main returned without exiting")
