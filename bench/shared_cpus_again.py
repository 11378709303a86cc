"""Every launch a proof kept, predicted again from its starting runs with the schedule run on the CPUs their ranks
shared (partition_plan.basis.shared_cpus, partition/shared_schedule.py) and with the pipeline model alone, against
what the launch measured: what the shared-CPU model changes, judged on launches already made.

    python bench/recompute_proof.py --rounds 3 --keep DIR ...      # once: the launches and their reports
    python bench/partition_proof.py --keep DIR                      # or these
    python bench/shared_cpus_again.py DIR

A recompute proof's DIR: for each case (CASE_start_none and CASE_start_all, the runs without and with every layer
recomputed) and each launch it kept (every round of it), the parts and the recompute per stage it ran, its measured
iteration (the median over its rounds of each report's steady iteration, totals.throughput_iter_s), and the
prediction from each starting run (report_recompute.recompute_what_if) as predicted / measured - 1.
A partition proof's DIR: for each run profiled under the default partition (NAME_stepN) and the launch of its plan
(NAME_planned_stepN, or step 3's plan where step N's is the same), the plan's predicted change from the default
(report_plan.plan_of with the planned parts) against the measured one (the two launches' steady iterations).
A starting run whose ranks had CPUs enough has no shared-CPU term: both columns are the same there. A report from
before forward_share was measured gets it here from its stages' forward and backward instruction times.
"""
import argparse
import copy
import statistics
import sys
from pathlib import Path

from recompute_peaks_again import report_in
from recompute_proof import ran_counts

from patches.partition.report_plan import PlanRequest, plan_of
from patches.partition.report_recompute import recompute_what_if


def both_models(report: dict):
    """(the report with the shared-CPU term, forward_share filled where it predates it; the report without it)."""
    shared = copy.deepcopy(report)
    basis = shared["partition_plan"].get("basis") or {}
    cpus = basis.get("shared_cpus")
    if cpus is not None and cpus.get("forward_share") is None:
        forward = sum(stage["fwd_latency_s"] for stage in report["stages"])
        cpus["forward_share"] = forward / (forward + sum(stage["bwd_latency_s"] for stage in report["stages"]))
    alone = copy.deepcopy(shared)
    (alone["partition_plan"].get("basis") or {})["shared_cpus"] = None
    return shared, alone


def said(report: dict) -> str:
    cpus = (report["partition_plan"].get("basis") or {}).get("shared_cpus")
    return (f"{cpus['ranks']} ranks of {cpus['threads']} thread(s) on {cpus['cpus']} CPUs ran {cpus['share']:.1%} of "
            f"their compute time" if cpus else "CPUs enough (no shared-CPU term)")


def recompute_proof(kept: Path, cases):
    for case in cases:
        print(f"{case}:\n\n| launch | parts | recompute per stage | measured ms | from the run without recompute: "
              "shared CPUs / pipeline alone | from the run with every layer recomputed: shared CPUs / pipeline "
              "alone |\n|---|---|---|---|---|---|")
        starts = [report_in(kept / f"{case}_start_{kind}") for kind in ("none", "all")]
        names = sorted({path.name[len(case) + 1:].rsplit("_round", 1)[0] for path in kept.glob(f"{case}_*_round*")})
        for name in names:
            reports = [report_in(path) for path in sorted(kept.glob(f"{case}_{name}_round*"))]
            reports = [report for report in reports if report is not None]
            if not reports:
                continue
            parts, counts = reports[0]["partition_plan"]["current_parts"], ran_counts(reports[0])
            measured = statistics.median(report["totals"]["throughput_iter_s"] for report in reports)
            cells = []
            for start in starts:
                shared, alone = (recompute_what_if(model, parts, counts)["predicted_iter_s"]
                                 for model in both_models(start))
                cells.append(f"{shared / measured - 1:+.1%} / {alone / measured - 1:+.1%}")
            print(f"| {name} | {parts} | {','.join(map(str, counts))} | {1e3 * measured:.1f} | {cells[0]} | "
                  f"{cells[1]} |")
        print()
        for kind, start in zip(("without recompute", "with every layer recomputed"), starts):
            print(f"- the starting run {kind}: {said(start)}")
        print()


def partition_proof(kept: Path, defaults):
    print("| run | planned parts | measured change | predicted: shared CPUs / pipeline alone |\n|---|---|---|---|")
    for default in defaults:
        start = report_in(default)
        name, step = default.name.rsplit("_step", 1)
        planned_dir = next((path for path in (kept / f"{name}_planned_step{step}", kept / f"{name}_planned_step3")
                            if report_in(path) is not None), None)
        if start is None or planned_dir is None:
            continue
        planned = report_in(planned_dir)
        parts = planned["partition_plan"]["current_parts"]
        measured = planned["totals"]["throughput_iter_s"] / start["totals"]["throughput_iter_s"] - 1
        shared, alone = (plan_of(model, PlanRequest(parts=parts))["predicted_change"] for model in both_models(start))
        print(f"| {default.name} ({said(start)}) | {parts} | {measured:+.1%} | {shared:+.1%} / {alone:+.1%} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kept", type=Path, help="the --keep directory of recompute_proof.py or partition_proof.py")
    kept = parser.parse_args().kept
    cases = sorted(path.name[:-len("_start_all")] for path in kept.glob("*_start_all"))
    defaults = sorted(path for path in kept.glob("*_step*") if "_planned_" not in path.name)
    if cases:
        recompute_proof(kept, cases)
    elif defaults:
        partition_proof(kept, defaults)
    else:
        sys.exit(f"error: no CASE_start_all or NAME_stepN directory in {kept}: give a proof's --keep DIR")


if __name__ == "__main__":
    main()
