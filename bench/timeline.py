"""`autofit ARGS` with every step its progress names (``progress.doing``) printed with its seconds, on stderr.

Where a plan's time goes, step by step and nested (a warm-up inside a size's timing inside the speed step): the
summary's "time by step" line splits it in five. Steps under 0.3 s are left out (SHORTEST_S=0.05 shows more).

    AUTOFIT_CACHE_DIR=$(mktemp -d) python bench/timeline.py plan bench/models47/resnet18_10.py --budget 200MiB --batch-size 32
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autofit.progress as progress  # noqa: E402

STARTED = time.monotonic()
SHORTEST_S = float(__import__("os").environ.get("SHORTEST_S", 0.3))
_depth = 0


def _timed(doing):
    @contextmanager
    def timed(self, what, *, step=None, of=None):
        global _depth
        began = time.monotonic()
        _depth += 1
        try:
            with doing(self, what, step=step, of=of):
                yield
        finally:
            _depth -= 1
            seconds = time.monotonic() - began
            if seconds >= SHORTEST_S:
                counted = f" ({step}/{of})" if step else ""
                print(f"  {began - STARTED:6.1f} +{seconds:5.2f}s {'  ' * _depth}{what}{counted}", file=sys.stderr)
    return timed


def main() -> None:
    for kind in vars(progress).values():
        if isinstance(kind, type) and issubclass(kind, progress.Progress) and kind is not progress.Progress:
            kind.doing = _timed(kind.doing)
    from autofit.entry import run

    sys.argv = ["autofit", *sys.argv[1:]]
    run()


if __name__ == "__main__":
    main()
