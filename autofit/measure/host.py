"""Host memory: tensors a strategy moved off the device, which the device's meter must not count.

On a GPU, offloaded activations and host-side optimizer state live in (pinned)
host memory, and the cuda meter never sees them. On the CPU the host is the
device, so a strategy makes its host copies inside ``host_allocation()``, and
``StorageTracker`` (the cpu and simulated meters) counts the storages created
there as host bytes, apart from the device peak. That keeps an offloading
strategy's saving measurable, and testable, without a GPU.

Storages made before a measurement begins (an optimizer's state, made before
the measured steps) are not seen being created: an optimizer that keeps
tensors on the host lists them in a ``host_tensors()`` method, and the meters
count those as host bytes (``host_tensors(optimizer)``).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_ON_HOST: ContextVar[bool] = ContextVar("autofit_host_allocation", default=False)


@contextmanager
def host_allocation() -> Iterator[None]:
    """Tensors created inside are host memory (see the module docstring)."""
    token = _ON_HOST.set(True)
    try:
        yield
    finally:
        _ON_HOST.reset(token)


def allocating_on_host() -> bool:
    """True inside ``host_allocation()``."""
    return _ON_HOST.get()


def host_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors ``optimizer`` keeps in host memory (its ``host_tensors()``); none for an optimizer without that method."""
    listed = getattr(optimizer, "host_tensors", None)
    return list(listed()) if callable(listed) else []
