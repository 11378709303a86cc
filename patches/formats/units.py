"""Numbers as the report prints them: counts, rates, bytes and durations, two decimals at most; and a memory size as
a user writes it ('80GB', '1.5GiB', parse_size), for the per-stage memory limit.

No torch import here: the command-line tools print with these, and they only read JSON (so they start at once).
"""
import re
from fractions import Fraction

_SCALES = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def _decimals(value):
    return f"{value:.2f}".rstrip("0").rstrip(".")


def number_to_string(num: float) -> str:
    """463210000 -> '463.21 M'."""
    for scale, unit in _SCALES:
        if abs(num) >= scale:
            return f"{_decimals(num / scale)} {unit}"
    return _decimals(num)


def params_to_string(params: int) -> str:
    return number_to_string(params).replace("G", "B")


def flops_rate_to_string(flops_per_s: float) -> str:
    """12.3e9 -> '12.3 GFLOPS'."""
    text = number_to_string(flops_per_s)
    return f"{text}FLOPS" if text[-1].isalpha() else f"{text} FLOPS"


def bytes_to_string(num: float) -> str:
    text = number_to_string(num)
    return f"{text}B" if text[-1].isalpha() else f"{text} B"


def duration_to_string(seconds: float) -> str:
    """29.87 -> '29.87 s', 0.11917 -> '119.17 ms'."""
    if seconds == 0 or seconds >= 1:
        return f"{_decimals(seconds)} s"
    if seconds >= 1e-3:
        return f"{_decimals(seconds * 1e3)} ms"
    return f"{_decimals(seconds * 1e6)} us"


_SIZE_UNITS = {"": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
               "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}
# ASCII only: an ignore-case [a-z] would also take the Kelvin sign for a K.
_SIZE = re.compile(r"\s*(-?)([0-9]+(?:\.[0-9]+)?) *([a-z]*)\s*", re.IGNORECASE | re.ASCII)
SIZE_FORMS = ("a positive number of bytes, or one with KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers "
              "of 1024), upper or lower case, e.g. 80GB or 1.5GiB")


def parse_size(text: str) -> int:
    """A size in bytes from '80GB' (80 * 1000**3), '1.5GiB' (1.5 * 1024**3), '512' (bytes): see SIZE_FORMS. A
    decimal is rounded down to a whole byte. ValueError, one line naming the accepted forms, for anything else,
    a negative size or one under a byte."""
    match = _SIZE.fullmatch(text)
    if match is None or match.group(3).lower() not in _SIZE_UNITS:
        raise ValueError(f"size {text!r} is not a size: give {SIZE_FORMS}")
    sign, number, unit = match.groups()
    if sign:
        raise ValueError(f"size {text!r} is negative: give {SIZE_FORMS}")
    # Fraction, not float: 2.01 * 1000 in floats is 2009.9999999999998, and '2.01KB' is 2010 bytes.
    size = int(Fraction(number) * _SIZE_UNITS[unit.lower()])
    if size == 0:
        raise ValueError(f"size {text!r} is {'zero' if Fraction(number) == 0 else 'under one byte'}: give {SIZE_FORMS}")
    return size
