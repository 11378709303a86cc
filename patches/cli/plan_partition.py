"""megatron-plan-partition REPORT.json [--pp N] [--parts 0,A,B,...,L] [--recompute K0,K1,...]
[--pp-partition-memory-limit SIZE]: the pipeline partition a profile report's measured layers ask for.

The report is a flops_profile_stepN.json of a PipelineModule's run (--profile-flops-step, the config section, or
PipelineFlopsProfiler.write_json). Prints each stage's load under the partition that ran and under the planned
one, the predicted iteration time, and how to use the plan; --pp plans for another number of stages. --parts
names a partition instead (each stage's first layer, then the number of layers: DeepSpeed's PipelineModule.parts)
and prints what the same model predicts for it, beside the partition that ran. Where the report has its memory
terms, each stage's predicted memory peak is printed too; --pp-partition-memory-limit plans with every stage's peak
within SIZE (default: the limit the report's own plan was made under, the device's that ran it, if any). Where no
partition fits, one line says by how much the closest exceeds, and the exit status is 2 (unless recomputing
makes one fit: the plan line then gives the partition with each stage's recompute). --recompute predicts a stage
recompute choice (--pp-recompute-layers' counts) for --parts, or the partition that ran.

Reads JSON only: no torch or DeepSpeed import, so it starts at once.
"""
import argparse
import re
import sys
from typing import List, Optional

from patches.formats.units import bytes_to_string, duration_to_string, parse_size
from patches.partition.memory_model import memory_terms_of
from patches.partition.plan_lines import no_fit_line, plan_line, recompute_what_if_line, what_if_line
from patches.partition.recompute import parse_recompute_layers
from patches.partition.report_file import read_report
from patches.partition.report_plan import PlanRequest, plan_of
from patches.partition.report_recompute import recompute_what_if
from patches.process.errors import PatchConfigError

# as the Megatron flag (patches/to_megatron/megatron_flags.py) spells it
MEMORY_LIMIT_FLAG = "--pp-partition-memory-limit"


def parse_parts(text: str, layers: int, pp: Optional[int]) -> List[int]:
    """--parts as given ('0,4,7'), checked against the report's number of layers and --pp when given: the
    boundaries of a contiguous partition with no stage empty. PatchConfigError, one line, otherwise."""
    form = f"give each stage's first layer, then {layers}, the report's number of layers: 0,...,{layers}"
    parts = []
    for item in text.split(","):
        # int() would also take '1_0' and other digits than 0-9: a boundary is written plainly.
        if not re.fullmatch(r"-?[0-9]+", item.strip()):
            raise PatchConfigError(f"--parts {text}: {item.strip()!r} is not an integer ({form})")
        parts.append(int(item))
    if len(parts) < 2:
        raise PatchConfigError(f"--parts {text}: one stage needs two boundaries, 0 and {layers} ({form})")
    if parts[0] != 0:
        raise PatchConfigError(f"--parts {text}: the first boundary is {parts[0]}, it must be 0 (the first layer)")
    if parts[-1] != layers:
        raise PatchConfigError(f"--parts {text}: the last boundary is {parts[-1]}, it must be {layers} (the report's "
                               "number of layers)")
    for before, after in zip(parts, parts[1:]):
        if after <= before:
            raise PatchConfigError(f"--parts {text}: {before} then {after}: the boundaries must increase strictly "
                                   "(every stage holds at least one layer)")
    if pp is not None and len(parts) - 1 != pp:
        raise PatchConfigError(f"--parts {text}: {len(parts) - 1} stages, but --pp {pp}")
    return parts


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-plan-partition", description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="a profile report's JSON (flops_profile_stepN.json)")
    parser.add_argument("--pp", type=int, default=None, help="plan for this many pipeline stages (default: as ran)")
    parser.add_argument("--parts", default=None, metavar="0,A,B,...,L",
                        help="predict this partition instead of planning one: each stage's first layer, then the "
                             "number of layers L (PipelineModule.parts)")
    parser.add_argument(MEMORY_LIMIT_FLAG, "--memory-limit", dest="memory_limit", default=None, metavar="SIZE",
                        help="plan with every stage's predicted memory peak within SIZE: bytes, or with KB, MB, GB, TB "
                             "or KiB, MiB, GiB, TiB (e.g. 80GB, 70GiB); default: the limit the report was planned "
                             "under (the device's that ran it), if any")
    parser.add_argument("--recompute", default=None, metavar="K0,K1,...",
                        help="with --parts (default: the partition that ran): predict stage s recomputing its first "
                             "K_s recomputable layers (--pp-recompute-layers)")
    args = parser.parse_args(argv)
    try:
        report = read_report(args.report)
        layers = report.get("layers")
        if not layers:
            raise PatchConfigError(f"the profile report {args.report} has no layer table (a PipelineModule's run "
                                   "profiled by this profiler has one)")
        if args.pp is not None and not 1 <= args.pp <= len(layers):
            raise PatchConfigError(f"--pp {args.pp}: the report's {len(layers)} layers make 1 to {len(layers)} stages")
        parts = parse_parts(args.parts, len(layers), args.pp) if args.parts is not None else None
        limit, source = report_limit(report)
        if args.memory_limit is not None:
            try:
                limit, source = parse_size(args.memory_limit), "flag"
            except ValueError as error:
                raise PatchConfigError(f"{MEMORY_LIMIT_FLAG} {args.memory_limit}: {error}") from None
        plan = plan_of(report, PlanRequest(stages=args.pp, parts=parts, limit=limit, limit_source=source))
        if args.recompute is not None:
            cut = parts or plan["current_parts"]
            what_if = recompute_what_if(report, cut, list(parse_recompute_layers(args.recompute, "--recompute")),
                                        limit)
    except PatchConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.recompute is not None:
        print("stage loads with recompute: " + ", ".join(duration_to_string(s) for s in what_if["stage_s"]))
        peaks = ", ".join(bytes_to_string(peak) for peak in what_if["predicted_peak_bytes"])
        print("stage peaks with recompute: " + peaks + (f" (limit {bytes_to_string(limit)})" if limit else ""))
        print(recompute_what_if_line(what_if, plan["measured_iter_s"], limit))
        return 0
    recomputing = (plan.get("recompute_plan") or {}).get("memory_fits")
    if parts is None and plan["memory_fits"] is False and not recomputing:
        print(f"error: {no_fit_line(plan)}", file=sys.stderr)
        return 2
    print(f"{len(layers)} layers, measured at pp {len(plan['current_parts']) - 1}, "
          f"{report['parallelism']['micro_batches']} micro-batches; iteration "
          f"{duration_to_string(plan['measured_iter_s'])} ({report['totals'].get('throughput_basis', 'measured')})")
    print("stage loads as run:     " + ", ".join(duration_to_string(s) for s in plan["current_stage_s"]))
    if parts is not None:
        # A what-if: the partition named, not a plan to use, so no "use it" line.
        print("stage loads with parts: " + ", ".join(duration_to_string(s) for s in plan["stage_s"]))
        print_peaks("stage peaks with parts: ", plan)
        print(what_if_line(plan))
        return 0
    print("stage loads as planned: " + ", ".join(duration_to_string(s) for s in plan["stage_s"]))
    print_peaks("stage peaks as planned: ", plan)
    print(plan_line(plan))
    limit = f" {MEMORY_LIMIT_FLAG} {args.memory_limit}" if args.memory_limit is not None else ""
    environment = f" and $DS_PIPE_PARTITION_MEMORY_LIMIT={args.memory_limit}" if args.memory_limit is not None else ""
    print(f"use it: --pp-partition-from-profile {args.report}{limit} (Megatron), or "
          f"PipelineModule(..., partition_method='profile:{args.report}'){environment} after patches.apply()")
    return 0


def report_limit(report: dict):
    """(bytes, source) of the memory limit the report's own plan was made under, where its terms can honour it."""
    plan = report.get("partition_plan") or {}
    if plan.get("memory_limit_bytes") is None or memory_terms_of(report) is None:
        return None, None
    return plan["memory_limit_bytes"], plan.get("memory_limit_source")


def print_peaks(label: str, plan: dict) -> None:
    """Each stage's predicted memory peak under the plan's parts, where the report has the terms to say."""
    peaks = plan.get("predicted_peak_bytes")
    if peaks is not None:
        limit = f" (limit {bytes_to_string(plan['memory_limit_bytes'])})" if plan["memory_limit_bytes"] else ""
        print(label + ", ".join(bytes_to_string(peak) for peak in peaks) + limit)


if __name__ == "__main__":
    sys.exit(main())
