"""CPUs that slow each other, taken into the plan's model: the plan's predicted change from the default partition
with that term and without it, against the change its launches measure, round by round.

    python bench/contention.py                          # the fork's unbalanced GPT at pp 2, 3 rounds
    python bench/contention.py --shape first-try --rounds 4 --checkpoint-activations
    python bench/contention.py --keep DIR               # keep every launch's report

One launch under the default partition profiled at step 3 plans the parts. Then each round launches the default
partition and the plan (--pp-partition-from-profile), interleaved, each profiled at its last iteration; a round's
default report, gathered with its ranks' together_rate (patches/profiler/host_contention.py), predicts the plan's
parts with the term (as the report is) and without it (its shared_cpus taken out where the CPUs were enough, or its
rate and stage shares where they were not: the model before the term). Each launch's time is the median of its
steady iterations (partition_speedup.steady_ms); a round's measured change is its plan's over its default's.
"""
import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path

# A script: its own directory is on sys.path, so the siblings import by name.
from harness import load, machine, table
from partition_speedup import DEFAULT_NAME, SHAPES, fork_target, launch, steady_ms

from patches.partition.report_plan import PlanRequest, plan_of


def without_the_term(report: dict) -> dict:
    """The report as the model read it before the rate was measured: no rate, one share for every stage, and no
    shared CPUs at all where there were CPUs enough."""
    older = copy.deepcopy(report)
    basis = older["partition_plan"]["basis"]
    shared = basis.get("shared_cpus")
    if shared:
        if shared["ranks"] * shared["threads"] <= shared["cpus"]:
            basis["shared_cpus"] = None
        else:
            shared.update(together_rate=None, stage_shares=None)
    return older


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=9, help="per launch, the last profiled")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="unbalanced")
    parser.add_argument("--checkpoint-activations", action="store_true")
    parser.add_argument("--keep", type=Path, help="a directory to keep every launch's report in")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    target = fork_target(shape)
    if args.checkpoint_activations:
        target.flags.append("--checkpoint-activations")
    print(machine(), flush=True)
    with tempfile.TemporaryDirectory(prefix="contention_") as scratch:
        work = args.keep or Path(scratch)
        _, first = launch(target, shape, args.pp, 6, target.methods[DEFAULT_NAME], work / "plan", step=3)
        parts = first["partition_plan"]["parts"]
        flags = {DEFAULT_NAME: target.methods[DEFAULT_NAME],
                 "plan": ["--pp-partition-from-profile", str(work / "plan" / "flops_profile_step3.json")]}
        print(f"pp {args.pp}, shape {shape}{', every layer recomputed' if args.checkpoint_activations else ''}: "
              f"the plan {parts} (from the default {first['partition_plan']['current_parts']})", flush=True)
        rows, errors = [], {"with": [], "without": []}
        for round_ in range(args.rounds):
            ms, reports = {}, {}
            for name, partition in flags.items():
                times, reports[name] = launch(target, shape, args.pp, args.iterations, partition,
                                              work / f"round{round_}_{name.split()[0]}")
                ms[name] = steady_ms(times, args.warmup, args.iterations)
            default = reports[DEFAULT_NAME]
            shared = default["partition_plan"]["basis"].get("shared_cpus") or {}
            with_term = plan_of(default, PlanRequest(parts=parts))["predicted_change"]
            without = plan_of(without_the_term(default), PlanRequest(parts=parts))["predicted_change"]
            measured = ms["plan"] / ms[DEFAULT_NAME] - 1
            errors["with"].append(with_term - measured)
            errors["without"].append(without - measured)
            rate = shared.get("together_rate")
            rows.append([str(round_ + 1), f"{rate:.2f}" if rate is not None else "-",
                         " / ".join(f"{share:.2f}" for share in shared.get("stage_shares") or []) or "-",
                         f"{ms[DEFAULT_NAME]:.1f}", f"{ms['plan']:.1f}", f"{100 * with_term:+.1f}%",
                         f"{100 * without:+.1f}%", f"{100 * measured:+.1f}%"])
            print("  " + " | ".join(rows[-1]), flush=True)
    print(table(["round", "together_rate", "stage shares", "default ms", "plan ms", "predicted, with the term",
                 "predicted, without", "measured"], rows))
    for name, values in errors.items():
        print(f"predicted minus measured change, {name} the term: median {100 * statistics.median(values):+.1f} "
              f"pts, from {100 * min(values):+.1f} to {100 * max(values):+.1f}")
    print(f"after: {load()}")


if __name__ == "__main__":
    sys.exit(main())
