"""megatron-plan-partition REPORT.json [--pp N]: the pipeline partition a profile report's measured layers ask for.

The report is a flops_profile_stepN.json of a PipelineModule's run (--profile-flops-step, the config section, or
PipelineFlopsProfiler.write_json). Prints each stage's load under the partition that ran and under the planned
one, the predicted iteration time, and how to use the plan; --pp plans for another number of stages.
"""
import argparse
import sys
from typing import List, Optional

from patches.errors import PatchConfigError
from patches.partition.planner import plan_line, plan_of, read_report
from patches.profiler.units import duration_to_string


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-plan-partition", description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="a profile report's JSON (flops_profile_stepN.json)")
    parser.add_argument("--pp", type=int, default=None, help="plan for this many pipeline stages (default: as ran)")
    args = parser.parse_args(argv)
    try:
        report = read_report(args.report)
        layers = report.get("layers")
        if not layers:
            raise PatchConfigError(f"the profile report {args.report} has no layer table (a PipelineModule's run "
                                   "profiled by this profiler has one)")
        if args.pp is not None and not 1 <= args.pp <= len(layers):
            raise PatchConfigError(f"--pp {args.pp}: the report's {len(layers)} layers make 1 to {len(layers)} stages")
        plan = plan_of(report, args.pp)
    except PatchConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{len(layers)} layers, measured at pp {len(plan['current_parts']) - 1}, "
          f"{report['parallelism']['micro_batches']} micro-batches; iteration "
          f"{duration_to_string(plan['measured_iter_s'])} ({report['totals'].get('throughput_basis', 'measured')})")
    print("stage loads as run:     " + ", ".join(duration_to_string(s) for s in plan["current_stage_s"]))
    print("stage loads as planned: " + ", ".join(duration_to_string(s) for s in plan["stage_s"]))
    print(plan_line(plan))
    print(f"use it: --pp-partition-from-profile {args.report} (Megatron), or "
          f"PipelineModule(..., partition_method='profile:{args.report}') after patches.apply()")
    return 0


if __name__ == "__main__":
    sys.exit(main())
