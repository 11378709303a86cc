"""Numbers as the report prints them: counts, rates, bytes and durations, two decimals at most.

No torch import here: the command-line tools print with these, and they only read JSON (so they start at once).
"""

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
