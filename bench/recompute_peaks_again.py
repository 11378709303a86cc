"""Every stage's peak of every launch a recompute proof kept, predicted again from its case's two starting runs by
the memory model as it is now, against the peak that launch measured (torch's allocator): a change to the model
is judged against launches already made, without launching again.

    python bench/recompute_proof.py --rounds 3 --keep DIR ...      # once: the launches and their reports
    python bench/recompute_peaks_again.py DIR

For each case (the kept directories named CASE_start_none and CASE_start_all, the runs without and with every
layer recomputed), each launch of its first round (and the starting runs themselves): the parts and the recompute
per stage it ran (its report's current_parts and the layers' recompute FLOPs), each stage's peak predicted from
each starting run (report_recompute.recompute_what_if) against its own measured peak, as predicted / measured - 1.
"""
import argparse
import json
import sys
from pathlib import Path

from recompute_proof import ran_counts

from patches.partition.report_recompute import recompute_what_if


def report_in(directory: Path):
    found = sorted(directory.glob("flops_profile_step*.json"))
    return json.loads(found[0].read_text()) if found else None


def kept_cases(description: str):
    """(the --keep directory named on the command line, its cases: each CASE with a CASE_start_all directory)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("kept", type=Path, help="the --keep directory of bench/recompute_proof.py")
    kept = parser.parse_args().kept
    cases = sorted(path.name[:-len("_start_all")] for path in kept.glob("*_start_all"))
    if not cases:
        sys.exit(f"error: no CASE_start_all directory in {kept}: give bench/recompute_proof.py's --keep DIR")
    return kept, cases


def main():
    kept, cases = kept_cases(__doc__.splitlines()[0])
    errors = []
    print("| case | launch | parts | recompute per stage | each stage's peak error, from the run without recompute "
          "| from the run with every layer recomputed |\n|---|---|---|---|---|---|")
    for case in cases:
        starts = [report_in(kept / f"{case}_start_{kind}") for kind in ("none", "all")]
        launches = sorted(kept.glob(f"{case}_*_round0")) + \
            [kept / f"{case}_start_{kind}" for kind in ("none", "all")]
        for directory in launches:
            report = report_in(directory)
            if report is None:
                continue
            parts, counts = report["partition_plan"]["current_parts"], ran_counts(report)
            measured = [stage["memory"]["measured_peak_bytes"] for stage in report["stages"]]
            cells = []
            for start in starts:
                predicted = recompute_what_if(start, parts, counts)["predicted_peak_bytes"]
                stage_errors = [p / m - 1 for p, m in zip(predicted, measured)]
                errors += stage_errors
                cells.append(" ".join(f"{error:+.1%}" for error in stage_errors))
            name = directory.name[len(case) + 1:].removesuffix("_round0")
            print(f"| {case} | {name} | {parts} | {','.join(map(str, counts))} | {cells[0]} | {cells[1]} |")
    print(f"\n{len(errors)} stage peaks: from {min(errors):+.1%} to {max(errors):+.1%}")


if __name__ == "__main__":
    main()
