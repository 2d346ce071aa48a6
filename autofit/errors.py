"""The one exception type a user can cause, and how to tell a failed allocation from other errors.

The CLI prints a ``UserError`` as a single line and exits non-zero; the
Python API raises it with the flags spelled as its keywords (``autofit.keywords``);
anything else is a bug and keeps its traceback. An error raised in the user's own code
(``user_frame`` finds where) becomes a ``UserError`` naming the file and line.
"""
from __future__ import annotations

import os
import traceback
from functools import lru_cache


class UserError(Exception):
    """A mistake in what the user asked for: the message names the bad value and the way out."""


def one_line(message: str) -> str:
    """``message`` on one line, whatever it carries (a library's error text may hold several)."""
    return "; ".join(part.strip() for part in message.splitlines() if part.strip())


_ALLOCATION_FAILURES = (
    "out of memory",  # CUDA's allocator, torch.OutOfMemoryError, HIP
    "can't allocate memory",  # the CPU allocator: "DefaultCPUAllocator: can't allocate memory"
    "_alloc_failed",  # cuBLAS, cuDNN, cuSOLVER, cuSPARSE, cuFFT: CUBLAS_STATUS_ALLOC_FAILED, CUDNN_STATUS_ALLOC_FAILED, ...
)


def is_out_of_memory(error: BaseException) -> bool:
    """True for an allocation that failed: torch.OutOfMemoryError, or a RuntimeError saying so in any library's words."""
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and any(words in message for words in _ALLOCATION_FAILURES)


def user_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``error``'s traceback in the user's own code: not Python's, an installed library's
    or autofit's. None when the error passed through none (it is then autofit's or a library's to report)."""
    roots = _library_roots()
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if frame.filename.startswith("<"):  # <frozen ...>, <string>
            continue
        if not os.path.realpath(frame.filename).startswith(roots):
            return frame
    return None


@lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    """Folders whose code is not the user's: the standard library, site-packages, autofit and strategies."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots |= set(site.getsitepackages()) | {site.getusersitepackages()}
    package = os.path.dirname(os.path.abspath(__file__))
    roots |= {package, os.path.join(os.path.dirname(package), "strategies")}  # strategies/ is installed beside autofit/
    return tuple(os.path.realpath(root) + os.sep for root in roots)
