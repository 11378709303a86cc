"""Every launch a recompute proof kept, its iteration predicted again from its case's two starting runs with and
without the floor of CPUs its ranks shared (partition_plan.basis.shared_cpus: no iteration shorter than the host's
work over its CPUs), against the iteration it measured: what the floor changes, judged on launches already made.

    python bench/recompute_proof.py --rounds 3 --keep DIR ...      # once: the launches and their reports
    python bench/cpu_floor_again.py DIR

For each case (CASE_start_none and CASE_start_all, the runs without and with every layer recomputed) and each launch
it kept (every round of it): the parts and the recompute per stage it ran, its measured iteration (the median over
its rounds of each report's steady iteration, totals.throughput_iter_s), and the prediction from each starting run
(report_recompute.recompute_what_if) as predicted / measured - 1, with the floor where the starting run measured one
and without it. A starting run whose ranks had CPUs enough has no floor: both columns are the same there.
"""
import copy
import statistics

from recompute_peaks_again import kept_cases, report_in
from recompute_proof import ran_counts

from patches.partition.report_recompute import recompute_what_if


def without_floor(report: dict) -> dict:
    unfloored = copy.deepcopy(report)
    (unfloored["partition_plan"].get("basis") or {})["shared_cpus"] = None
    return unfloored


def main():
    kept, cases = kept_cases(__doc__.splitlines()[0])
    for case in cases:
        print(f"{case}:\n\n| launch | parts | recompute per stage | measured ms | from the run without recompute: "
              "with the floor / without | from the run with every layer recomputed: with the floor / without |\n"
              "|---|---|---|---|---|---|")
        starts = [report_in(kept / f"{case}_start_{kind}") for kind in ("none", "all")]
        shared = [(start["partition_plan"].get("basis") or {}).get("shared_cpus") for start in starts]
        names = sorted({path.name[len(case) + 1:].rsplit("_round", 1)[0]
                        for path in kept.glob(f"{case}_*_round*")})
        for name in names:
            reports = [report_in(path) for path in sorted(kept.glob(f"{case}_{name}_round*"))]
            reports = [report for report in reports if report is not None]
            if not reports:
                continue
            parts, counts = reports[0]["partition_plan"]["current_parts"], ran_counts(reports[0])
            measured = statistics.median(report["totals"]["throughput_iter_s"] for report in reports)
            cells = []
            for start in starts:
                floored = recompute_what_if(start, parts, counts)["predicted_iter_s"]
                plain = recompute_what_if(without_floor(start), parts, counts)["predicted_iter_s"]
                cells.append(f"{floored / measured - 1:+.1%} / {plain / measured - 1:+.1%}")
            print(f"| {name} | {parts} | {','.join(map(str, counts))} | {1e3 * measured:.1f} | {cells[0]} | "
                  f"{cells[1]} |")
        print()
        for kind, cpus in zip(("without recompute", "with every layer recomputed"), shared):
            said = (f"{cpus['ranks']} ranks of {cpus['threads']} thread(s) on {cpus['cpus']} CPUs ran "
                    f"{cpus['share']:.1%} of their compute time" if cpus else "CPUs enough (no floor)")
            print(f"- the starting run {kind}: {said}")
        print()


if __name__ == "__main__":
    main()
