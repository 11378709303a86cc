"""The optimizer's floor under the step transient (partition/memory_model.py), measured: one profile under the default
partition predicts each stage's peak under DeepSpeed's other partition methods, with the floor and without it, and
each method is launched and its peaks measured (torch's allocator, the profiler's reading).

    python bench/step_floor.py                 # pp 4, bench/partition_speedup.py's GPT (its LM head over 16,384 words)
    python bench/step_floor.py --pp 2 --shape first-try

torch's AdamW on CPU updates one tensor at a time (foreach off): its own step holds temporaries of each parameter in
turn, so `optimizer_step_transient_bytes` follows a stage's largest parameter, while the rest of the step (the
gradients' reduction) follows its state. DeepSpeed's `parameters` method leaves the embedding alone on stage 0 at
pp 4: its state shrinks, its optimizer transient does not. Each launch profiles iteration 3 of 4 (one thread a
rank); the table gives, per method and stage, the measured peak and each prediction's error.
"""
import argparse
import copy
import sys
import tempfile
from pathlib import Path

# A script: its own directory is on sys.path, so the sibling modules import by name.
from harness import machine, table
from partition_speedup import DEFAULT_NAME, METHODS, SHAPES, fork_target, launch

from patches.partition.report_plan import PlanRequest, plan_of

STEP, ITERATIONS = 3, 4


def without_floor(report: dict) -> dict:
    """The report as one from before the floor's terms were read: no layer's largest parameter."""
    older = copy.deepcopy(report)
    for row in older["layers"]:
        row.pop("largest_param_bytes", None)
    return older


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="unbalanced")
    parser.add_argument("--keep", type=Path, help="keep each launch's reports in this directory")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    target = fork_target(shape)
    print(machine())
    with tempfile.TemporaryDirectory() as scratch:
        work = args.keep or Path(scratch)
        reports = {name: launch(target, shape, args.pp, ITERATIONS, target.methods[name], work / str(place),
                                step=STEP)[1] for place, name in enumerate(METHODS)}
    profile = reports[DEFAULT_NAME]
    print(f"\nprofile: {DEFAULT_NAME}, parts {profile['partition_plan']['current_parts']}; per stage, the optimizer's "
          f"own step transient and the stage's largest parameter (bytes):")
    largest = {}
    for row in profile["layers"]:
        largest[row["stage"]] = max(largest.get(row["stage"], 0), row["largest_param_bytes"])
    for stage in profile["stages"]:
        memory = stage["memory"]
        print(f"  stage {stage['stage_id']}: {memory['optimizer_step_transient_bytes']:,} of a step transient of "
              f"{memory['step_transient_bytes']:,}; largest parameter {largest[stage['stage_id']]:,}")
    rows = []
    for name, report in reports.items():
        parts = report["partition_plan"]["current_parts"]
        floored = plan_of(profile, PlanRequest(parts=parts))["predicted_peak_bytes"]
        plain = plan_of(without_floor(profile), PlanRequest(parts=parts))["predicted_peak_bytes"]
        for stage, (with_floor, before) in enumerate(zip(floored, plain)):
            measured = report["stages"][stage]["memory"]["measured_peak_bytes"]
            rows.append([name, str(parts), str(stage), f"{measured / 1e6:.2f} MB",
                         f"{with_floor / measured - 1:+.1%}", f"{before / measured - 1:+.1%}"])
    print()
    print(table(["method", "parts", "stage", "measured peak", "predicted, floor", "predicted, no floor"], rows))


if __name__ == "__main__":
    sys.exit(main())
