"""Byte budgets: parsing "16GB" / "16GiB" / "90%" and printing byte counts."""
from __future__ import annotations

import re

from autofit.errors import UserError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*|%)\s*$")


def parse_budget(text: str | int | float, *, device_total_bytes: int | None = None) -> int:
    """Parse a memory budget into bytes.

    Args:
        text: "16GB" (10^9 bytes), "16GiB" (2^30), "512MB", "512MiB", "90%" (of the
            device's total memory) or a plain number of bytes.
        device_total_bytes: the device's total memory; needed only for percentages.

    Returns:
        The budget in bytes, always > 0.

    Raises:
        UserError: the text is not a positive size in a known unit.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = str(text)
    match = _BUDGET.match(str(text))
    hint = 'use a positive size such as "16GB", "16GiB", "512MiB", "90%" or a number of bytes'
    if not match:
        raise UserError(f"budget {text!r} is not a memory size; {hint}")
    number, unit = float(match.group(1)), match.group(2).upper()
    if unit == "%":
        if not 0 < number <= 100:
            raise UserError(f"budget {text!r} must be a percentage in (0, 100]")
        if device_total_bytes is None:
            raise UserError(f"budget {text!r} is a percentage, but the device's total memory is unknown; give bytes, e.g. \"16GB\"")
        budget = int(device_total_bytes * number / 100)
    elif unit in _UNITS:
        budget = int(number * _UNITS[unit])
    else:
        raise UserError(f"budget {text!r} has an unknown unit {match.group(2)!r}; {hint}")
    if budget <= 0:
        raise UserError(f"budget {text!r} must be more than 0 bytes; {hint}")
    return budget


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_rate(per_second: float) -> str:
    """A speed with three significant digits, whole above 100: 0.0123, 1.1, 8.42, 103, 12345.

    Example:
        >>> format_rate(0.01234), format_rate(8.4167), format_rate(12345.6)
        ('0.0123', '8.42', '12346')
    """
    return f"{per_second:.0f}" if per_second >= 100 else f"{per_second:.3g}"
