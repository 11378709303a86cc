"""Everything the profiler writes to disk: the report's JSON and its schema, the Chrome trace, and
the report's headline numbers as TensorBoard scalars.

The schema, flops-profile.schema.json, lies beside this file and is loaded by its path relative to
this module (an installed wheel carries it as package data).
"""
import json
import os
import tempfile
from typing import Any, Dict, Optional

SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flops-profile.schema.json")


def load_schema() -> dict:
    with open(SCHEMA_PATH) as f:
        return json.load(f)


def validate_report(report: dict) -> None:
    """Raise jsonschema.ValidationError if `report` breaks the schema."""
    try:
        import jsonschema
    except ImportError as e:
        raise ImportError("validating a profile report needs jsonschema: pip install jsonschema "
                          "(it is in this package's 'test' extra)") from e
    jsonschema.Draft202012Validator(load_schema()).validate(report)


def write_json(report: dict, path: str, indent: Optional[int] = 2) -> None:
    """Write atomically: readers never see half a report (or half a trace)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".flops_profile.", suffix=".tmp", dir=directory)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide the report from other users
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=indent)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_text(text: str, path: str) -> None:
    """The printed report, to a file (the flops_profiler section's output_file)."""
    with open(path, "w") as f:
        f.write(text + "\n")


def write_trace(trace: dict, path: str) -> None:
    """Atomically, compact (a trace has many events)."""
    write_json(trace, path, indent=None)


def profile_scalars(report: dict) -> Dict[str, float]:
    """{tag: value}: the report's headline numbers as TensorBoard scalars (null values left out)."""
    totals = report["totals"]
    scalars = {f"flops-profile/{key.replace('_', '-')}": totals[key]
               for key in ("tflops_per_gpu", "model_tflops_per_gpu", "mfu", "iter_latency_s", "fwd_latency_s",
                           "bwd_latency_s", "step_latency_s", "samples_per_s", "tokens_per_s",
                           "measured_over_analytic")}
    bubble = report.get("bubble")
    idle = {row["stage_id"]: row["idle_fraction"] for row in bubble["stages"]} if bubble else {}
    if bubble:
        scalars["flops-profile/bubble-ideal-fraction"] = bubble["ideal_fraction"]
    for stage in report["stages"]:
        prefix = f"flops-profile/stage{stage['stage_id']}"
        for key in ("tflops_per_gpu", "fwd_latency_s", "bwd_latency_s", "step_latency_s", "comm_s",
                    "train_batch_latency_s"):
            scalars[f"{prefix}/{key.replace('_', '-')}"] = stage[key]
        scalars[f"{prefix}/idle-fraction"] = idle.get(stage["stage_id"])
    return {tag: float(value) for tag, value in scalars.items() if value is not None}


def write_tensorboard_scalars(report: dict, writer: Any, step: int) -> None:
    """Add profile_scalars(report) to a TensorBoard SummaryWriter at `step`, and flush."""
    for tag, value in profile_scalars(report).items():
        writer.add_scalar(tag, value, step)
    writer.flush()
