"""The one exception type a user can cause, and how to tell a failed allocation from other errors.

The CLI prints a ``UserError`` as a single line and exits non-zero; anything
else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in what the user asked for: the message names the bad value and the way out."""


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
