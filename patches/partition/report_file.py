"""A saved profile report read from its file: the JSON, and the fields planning reads checked, each missing one
said in one line (megatron-plan-partition, --pp-partition-from-profile, partition_method='profile',
megatron-profile-page)."""
import json
from typing import Optional

from patches.process.errors import PatchConfigError


def read_json(path: str, what: str = "the profile report"):
    """The JSON at `path` (`what` names it in the error); PatchConfigError, one line, where it cannot be read or
    is not JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as error:
        raise PatchConfigError(f"{what} {path} cannot be read: {error.strerror}") from None
    except ValueError as error:
        raise PatchConfigError(f"{what} {path} is not the profiler's JSON: {error}") from None


def read_report(path: str) -> dict:
    """The profiler's JSON at `path`, checked for what planning reads. PatchConfigError, one line, otherwise."""
    report = read_json(path)
    problem = _what_planning_lacks(report)
    if problem:
        raise PatchConfigError(f"the profile report {path} is not the profiler's JSON: {problem}")
    return report


_LAYER_FIELDS = {"index": int, "type": str, "stage": int, "fwd_latency_s": (int, float),
                 "bwd_latency_s": (int, float), "recompute_latency_s": (int, float)}


def _what_planning_lacks(report) -> Optional[str]:
    """What a report lacks of the fields planning reads (a missing layer table is the callers' to say)."""
    if not isinstance(report, dict):
        return f"a JSON {type(report).__name__}, not an object"
    for section, field, kind in (("totals", "throughput_iter_s", (int, float)),
                                 ("parallelism", "micro_batches", int)):
        value = report.get(section, {}).get(field) if isinstance(report.get(section), dict) else None
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"no {section}.{field}"
    layers = report.get("layers")
    if layers is None:
        return None
    if not isinstance(layers, list):
        return "its layers are not a list"
    for position, row in enumerate(layers):
        for field, kind in _LAYER_FIELDS.items():
            if not isinstance(row, dict) or not isinstance(row.get(field), kind) or isinstance(row.get(field), bool):
                return f"layer {position} has no {field}"
    if sorted(row["index"] for row in layers) != list(range(len(layers))):
        return "its layers are not numbered 0 to n - 1"
    return None
