"""The proof of the memory-aware partition plan: each plan's predicted iteration time and per-stage memory peaks
against what a launch of it measures, on the GPT whose LM head weighs down the last stage.

    python bench/partition_proof.py                    # the fork, pp 2 and 4, checkpointing off and on, steps 3, 10
    python bench/partition_proof.py --pp 2 --steps 3 --checkpointing off     # one sub-case
    python bench/partition_proof.py --quick            # the tiny GPT, pp 2, step 3, off: a smoke run
    python bench/partition_proof.py --upstream DIR --upstream-python PY [--no-fork]   # upstream's too

For each target, pipeline size, activation checkpointing and profiled step S: a launch under the default
partition profiled at S (train-iters S + 5, so its report's baseline is S+1 .. S+3) gives each stage's
predicted and measured memory peak and the plan; its log lines' median iteration time (warm-up, S-1, S and
S+3, which delivers the report, left out) is compared with the report's prediction for its own partition. Then
a launch of the plan (--pp-partition-from-profile that report), 9 iterations profiled at the last so that 2 .. 7
are timed: the plan's predicted iteration time and peaks against that launch's measured
median and peaks, and the plan's predicted change from the default (both predictions from the same report) beside
its launch's measured change from the default launch: on a machine whose speed drifts between launches (this one:
the same partition's median 12% apart in two launches minutes apart) the ratio holds where the absolute time
cannot. Where two steps plan the same parts, one planned launch serves both. Last, the memory-limit
case: a limit between the least peak any partition reaches and the largest peak of the time-optimal plan, the plan
under it (--pp-partition-memory-limit) launched and its peaks measured. It plans from the first of the fork's
default launches (checkpointing off) where such a limit exists. On UNBALANCED none does: the LM head alone is the
largest stage at any pp, in the time-optimal plan too. Then it launches LIMIT_SHAPE at pp 4 (profiled at step 3)
for it: the vocabulary at 4,096 makes the head light, and the first stage, with 4 micro-batches in flight, sets
the peak of the time-optimal plan.

The shapes are partition_speedup.py's: UNBALANCED for the fork, UPSTREAM_SHAPE for upstream (TINY and
UPSTREAM_QUICK under --quick). Errors are predicted / measured - 1; one over 10% (the acceptance bar) is in bold
and listed at the end. The tables are markdown, for docs/benchmarks.md.
"""
import argparse
import contextlib
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

# A script: its own directory is on sys.path, so the siblings import by name.
import partition_speedup as speedup
from harness import load, machine

from patches.partition.memory_model import memory_terms_of
from patches.partition.planner import least_peak_parts
from patches.partition.report_plan import PlanRequest, peak_of, plan_of

MB = 1000 ** 2  # the report's MB
BAR = 0.10  # the acceptance bar on every error
WARMUP = 1  # iterations left out of a launch's median at its start
CHECKPOINTING = {"off": [], "on": ["--checkpoint-activations"]}
# the limit case's own GPT where the default run's has no room for a limit: UNBALANCED with a light LM head
LIMIT_SHAPE = dict(speedup.UNBALANCED, vocab=4096)
LIMIT_PP, LIMIT_STEP = 4, 3


@dataclass
class Settings:
    """How long each launch runs."""
    after: int  # iterations after the profiled step of a default launch (3 for the report's baseline, 1 delivers)
    planned_iterations: int  # a planned launch's, the last profiled


@dataclass
class Case:
    """One target, pipeline size and checkpointing: the flags every launch of it shares."""
    name: str  # "fork" or "upstream"
    target: object  # partition_Target
    shape: dict
    pp: int
    checkpointing: str

    def flags(self, partition):
        return CHECKPOINTING[self.checkpointing] + partition


@dataclass
class Run:
    """One launch: the parts it ran, its log lines' median, its report and where that was written."""
    parts: List[int]
    measured_ms: float
    report: dict
    path: Path
    seconds: float  # the launch's wall time, for the estimate of a full run


@dataclass
class Row:
    """A line of the table: a partition's predicted time and peaks beside a launch's measured ones."""
    case: Case
    step: str
    partition: str
    parts: List[int]
    predicted_ms: float
    measured_ms: float
    predicted_peaks: List[Optional[int]]
    measured_peaks: List[Optional[int]]
    # a plan's: its predicted iteration over the default's from the same report, and its launch's median over the
    # default launch's (both - 1); None on a default row. Drift between launches leaves the ratio alone.
    predicted_change: Optional[float] = None
    measured_change: Optional[float] = None


def run(case, partition, iterations, step, out, work):
    """One launch of the case with these partition flags, iteration `step` profiled."""
    start = time.perf_counter()
    times, report = speedup.launch(case.target, case.shape, case.pp, iterations, case.flags(partition), work / out,
                                   step)
    seconds = time.perf_counter() - start
    measured = speedup.steady_ms(times, WARMUP, iterations, step)
    parts = report["partition_plan"]["current_parts"]
    each = " ".join(f"{ms:.0f}" for _, ms in sorted(times.items()))
    print(f"  {out}: parts {parts}, median {measured:.1f} ms ({seconds:.0f} s; ms by iteration: {each})", flush=True)
    return Run(parts, measured, report, work / out / f"flops_profile_step{step}.json", seconds)


def stage_peaks(report, field):
    return [(stage.get("memory") or {}).get(field) for stage in report["stages"]]


def default_row(case, step, default):
    """The default launch against its own report: the prediction for the partition that ran, the peaks."""
    own = plan_of(default.report, PlanRequest(parts=default.parts))
    return Row(case, str(step), "default", default.parts, own["predicted_iter_s"] * 1000, default.measured_ms,
               stage_peaks(default.report, "predicted_peak_bytes"), stage_peaks(default.report, "measured_peak_bytes"))


def planned_row(case, step, plan, planned, shared, default):
    """The plan of a default launch's report against the launch of it, and the change from the default."""
    partition = "planned" + (f" (the launch of step {shared}'s plan)" if shared else "")
    if planned.parts != plan["parts"]:
        partition += f" (ran {planned.parts})"
    own = plan_of(default.report, PlanRequest(parts=default.parts))
    return Row(case, str(step), partition, plan["parts"], plan["predicted_iter_s"] * 1000, planned.measured_ms,
               plan["predicted_peak_bytes"] or [None] * case.pp, stage_peaks(planned.report, "measured_peak_bytes"),
               plan["predicted_iter_s"] / own["predicted_iter_s"] - 1, planned.measured_ms / default.measured_ms - 1)


def prove(case, steps, settings, work):
    """The rows of one case: for each step, the default launch and the launch of its plan (shared by equal plans);
    and the default launches, by step, for the limit case."""
    rows, defaults, planned_by_parts = [], {}, {}
    label = f"{case.name}_pp{case.pp}_ckpt{case.checkpointing}"
    print(f"{case.target.name}: pp {case.pp}, checkpointing {case.checkpointing}", flush=True)
    for step in steps:
        default = run(case, case.target.methods[speedup.DEFAULT_NAME], step + settings.after, step,
                      f"{label}_step{step}", work)
        defaults[step] = default
        rows.append(default_row(case, step, default))
        plan = default.report["partition_plan"]
        key = tuple(plan["parts"])
        shared = planned_by_parts.get(key)
        if shared is None:
            planned = run(case, ["--pp-partition-from-profile", str(default.path)], settings.planned_iterations,
                          settings.planned_iterations, f"{label}_planned_step{step}", work)
            planned_by_parts[key] = (step, planned)
        else:
            print(f"  step {step} plans {list(key)} as step {shared[0]} did: its launch serves both", flush=True)
        first, planned = planned_by_parts[key]
        rows.append(planned_row(case, step, plan, planned, first if first != step else None, default))
    return rows, defaults


# ---------------------------------------------------------------- the memory limit
@dataclass
class LimitCase:
    """The limit chosen between the least achievable peak and the time-optimal plan's, the plan under it and the
    launch of that plan."""
    case: Case
    step: int
    time_optimal: dict
    least_parts: List[int]
    least_peak: int
    limit: int
    chosen: dict
    run: Run


def limit_between(report):
    """(limit, least parts, least peak): halfway between the least largest peak any partition reaches and the
    largest of the time-optimal plan's; None where the time-optimal plan already has the least."""
    plan = report["partition_plan"]
    pp = len(plan["parts"]) - 1
    peak = peak_of(memory_terms_of(report), pp, report["parallelism"]["micro_batches"],
                   (report.get("bubble") or {}).get("schedule"))
    if peak is None or not plan["predicted_peak_bytes"]:
        return None
    least_parts, least = least_peak_parts(peak, len(report["layers"]), pp)
    highest = max(plan["predicted_peak_bytes"])
    if least >= highest:
        return None
    return (least + highest) // 2, least_parts, least


def prove_limit(case, step, default, settings, work):
    """The plan under a limit that rules the time-optimal plan out, launched."""
    limit, least_parts, least = limit_between(default.report)
    chosen = plan_of(default.report, PlanRequest(limit=limit, limit_source="flag"))
    print(f"{case.target.name}: pp {case.pp}, checkpointing {case.checkpointing}, memory limit {limit} bytes",
          flush=True)
    flags = ["--pp-partition-from-profile", str(default.path), "--pp-partition-memory-limit", str(limit)]
    launched = run(case, flags, settings.planned_iterations, settings.planned_iterations,
                   f"{case.name}_pp{case.pp}_limit", work)
    return LimitCase(case, step, default.report["partition_plan"], least_parts, least, limit, chosen, launched)


def memory_limit_case(fork_defaults, settings, work):
    """The limit case from the first of the fork's default launches (checkpointing off) with room for a limit,
    else from a launch of LIMIT_SHAPE; None where neither has any. fork_defaults: (case, step, run)."""
    for case, step, default in fork_defaults:
        if case.checkpointing == "off" and limit_between(default.report) is not None:
            return prove_limit(case, step, default, settings, work)
    print(f"limit case: no default launch of this run has room for a limit (its time-optimal plan already has the "
          f"least peak); launching {LIMIT_SHAPE} at pp {LIMIT_PP}", flush=True)
    case = Case("fork", speedup.fork_target(LIMIT_SHAPE), LIMIT_SHAPE, LIMIT_PP, "off")
    default = run(case, case.target.methods[speedup.DEFAULT_NAME], LIMIT_STEP + settings.after, LIMIT_STEP,
                  "fork_limit_shape", work)
    if limit_between(default.report) is None:
        print(f"limit case: none either in {default.report['partition_plan']['parts']}", flush=True)
        return None
    return prove_limit(case, LIMIT_STEP, default, settings, work)


# ---------------------------------------------------------------- printing
def error(predicted, measured):
    return predicted / measured - 1 if predicted is not None and measured else None


def percent(value):
    """An error as a percentage, in bold over the bar."""
    if value is None:
        return "n/a"
    text = f"{value:+.1%}"
    return f"**{text}**" if abs(value) > BAR else text


def megabytes(value):
    return "n/a" if value is None else f"{value / MB:.2f}"


def peak_cell(predicted, measured):
    return f"{megabytes(predicted)} / {megabytes(measured)} ({percent(error(predicted, measured))})"


def change_cell(row):
    if row.predicted_change is None:
        return ""
    return f"{row.predicted_change:+.1%} / {row.measured_change:+.1%}"


def markdown(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def print_rows(rows, pp):
    headers = ["target", "pp", "checkpointing", "step", "partition", "parts", "predicted ms", "measured median ms",
               "error", "change from default, predicted / measured"] + \
        [f"stage {s} peak MB, predicted / measured (error)" for s in range(pp)]
    lines = [[row.case.name, pp, row.case.checkpointing, row.step, row.partition, row.parts,
              f"{row.predicted_ms:.1f}", f"{row.measured_ms:.1f}", percent(error(row.predicted_ms, row.measured_ms)),
              change_cell(row)]
             + [peak_cell(p, m) for p, m in zip(row.predicted_peaks, row.measured_peaks)] for row in rows]
    print(f"\npp {pp}:\n")
    print(markdown(headers, lines))


def print_limit(proof):
    """The limit, the time-optimal plan it rules out (not launched) and the plan under it against its launch."""
    chosen, optimal = proof.chosen, proof.time_optimal
    measured = stage_peaks(proof.run.report, "measured_peak_bytes")
    within = all(m is not None and m <= proof.limit for m in measured)
    print(f"\nmemory limit {megabytes(proof.limit)} MB (fork, pp {proof.case.pp}, checkpointing off, shape "
          f"{proof.case.shape}; planned from the default partition's report of step {proof.step}): between the least "
          f"largest peak any partition reaches, {megabytes(proof.least_peak)} MB ({proof.least_parts}), and the "
          f"time-optimal plan's {megabytes(max(optimal['predicted_peak_bytes']))} MB\n")
    headers = ["plan", "parts", "predicted ms", "measured median ms", "error"] + \
        [f"stage {s} peak MB, predicted / measured (error)" for s in range(len(measured))] + ["within the limit"]
    ran = "" if proof.run.parts == chosen["parts"] else f" (ran {proof.run.parts})"
    rows = [["time-optimal (not launched)", optimal["parts"], f"{optimal['predicted_iter_s'] * 1000:.1f}", "", ""]
            + [f"{megabytes(p)} / -" for p in optimal["predicted_peak_bytes"]] + ["no (predicted)"],
            [f"under the limit{ran}", chosen["parts"], f"{chosen['predicted_iter_s'] * 1000:.1f}",
             f"{proof.run.measured_ms:.1f}", percent(error(chosen["predicted_iter_s"] * 1000, proof.run.measured_ms))]
            + [peak_cell(p, m) for p, m in zip(chosen["predicted_peak_bytes"], measured)]
            + [("yes" if within else "**no**") + f" (predicted: {'yes' if chosen['memory_fits'] else 'no'})"]]
    print(markdown(headers, rows))


def over_the_bar(rows, limit):
    """Each error over the bar, one line each."""
    lines = []
    for row in rows:
        where = f"{row.case.name} pp {row.case.pp} checkpointing {row.case.checkpointing} step {row.step} " \
                f"{row.partition}"
        time_error = error(row.predicted_ms, row.measured_ms)
        if time_error is not None and abs(time_error) > BAR:
            lines.append(f"{where}: iteration time {time_error:+.1%}")
        for stage, (p, m) in enumerate(zip(row.predicted_peaks, row.measured_peaks)):
            peak_error = error(p, m)
            if peak_error is not None and abs(peak_error) > BAR:
                lines.append(f"{where}: stage {stage} peak {peak_error:+.1%}")
    if limit is not None:
        time_error = error(limit.chosen["predicted_iter_s"] * 1000, limit.run.measured_ms)
        if abs(time_error) > BAR:
            lines.append(f"limit run: iteration time {time_error:+.1%}")
        measured = stage_peaks(limit.run.report, "measured_peak_bytes")
        for stage, (p, m) in enumerate(zip(limit.chosen["predicted_peak_bytes"], measured)):
            if m is None or m > limit.limit:
                lines.append(f"limit run: stage {stage} measured {megabytes(m)} MB over the limit "
                             f"{megabytes(limit.limit)} MB")
            elif abs(error(p, m)) > BAR:
                lines.append(f"limit run: stage {stage} peak {error(p, m):+.1%}")
    return lines


def print_ending(title, flagged, start):
    """Each flagged line under its count, then the run's wall time and the machine's load after it."""
    print(f"\n{title}: " + ("none" if not flagged else f"{len(flagged)}"))
    for line in flagged:
        print(f"- {line}")
    print(f"\n{time.perf_counter() - start:.0f} s in all")
    print(f"after: {load()}")


# ---------------------------------------------------------------- main
def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, nargs="+", default=[3, 10], help="the default launches' profiled steps")
    parser.add_argument("--checkpointing", nargs="+", choices=list(CHECKPOINTING), default=list(CHECKPOINTING))
    parser.add_argument("--no-fork", action="store_true", help="upstream's pretrain_gpt.py alone")
    parser.add_argument("--no-limit", action="store_true", help="leave out the memory-limit case")
    parser.add_argument("--limit-only", action="store_true", help="the memory-limit case alone")
    parser.add_argument("--quick", action="store_true", help="the tiny GPT, pp 2, step 3, checkpointing off")
    parser.add_argument("--upstream", metavar="DIR", help="an upstream Megatron-DeepSpeed checkout to run too")
    parser.add_argument("--upstream-python", metavar="PY", default=sys.executable,
                        help="the interpreter of the environment upstream runs in (default: this one)")
    parser.add_argument("--keep", metavar="DIR", type=Path,
                        help="run in DIR and keep every launch's reports and logs there (default: a temporary one)")
    args = parser.parse_args()
    if args.no_fork and not args.upstream:
        parser.error("--no-fork leaves nothing to run without --upstream")
    if args.limit_only and (args.no_limit or args.no_fork):
        parser.error("--limit-only runs the fork's memory-limit case alone")
    if args.quick:
        args.pp, args.steps, args.checkpointing = [2], [3], ["off"]
    args.no_limit = args.no_limit or args.no_fork  # the limit case is the fork's
    return args


def targets(args, work):
    """(name, target, shape) of each pretrain_gpt.py to run."""
    chosen = []
    if not args.no_fork:
        shape = speedup.TINY if args.quick else speedup.UNBALANCED
        chosen.append(("fork", speedup.fork_target(shape), shape))
    if args.upstream:
        shape = speedup.UPSTREAM_QUICK if args.quick else speedup.UPSTREAM_SHAPE
        chosen.append(("upstream", speedup.upstream_target(args.upstream, args.upstream_python, shape, work), shape))
    return chosen


def prove_all(args, settings, work):
    """Every target x pp x checkpointing asked for: the rows by pp, and the fork's default launches as
    (case, step, run) for the limit case."""
    rows: Dict[int, List[Row]] = {pp: [] for pp in args.pp}
    fork_defaults = []
    for name, target, shape in targets(args, work):
        print(f"{name}: shape {shape}", flush=True)
        for pp in args.pp:
            for checkpointing in args.checkpointing:
                case = Case(name, target, shape, pp, checkpointing)
                case_rows, defaults = prove(case, args.steps, settings, work)
                rows[pp] += case_rows
                fork_defaults += [(case, step, default) for step, default in defaults.items() if name == "fork"]
    return rows, fork_defaults


def main():
    args = parse()
    settings = Settings(after=4, planned_iterations=5) if args.quick else Settings(after=5, planned_iterations=9)
    print(machine(), flush=True)
    start = time.perf_counter()
    rows, limit = {}, None
    with (contextlib.nullcontext(str(args.keep)) if args.keep
          else tempfile.TemporaryDirectory(prefix="partition_proof_")) as work:
        if not args.limit_only:
            rows, fork_defaults = prove_all(args, settings, Path(work))
        if not args.no_limit:
            limit = memory_limit_case(fork_defaults if not args.limit_only else [], settings, Path(work))
    for pp, pp_rows in rows.items():
        print_rows(pp_rows, pp)
    if limit is not None:
        print_limit(limit)
    flagged = over_the_bar([row for pp_rows in rows.values() for row in pp_rows], limit)
    print_ending(f"errors over the {BAR:.0%} bar", flagged, start)


if __name__ == "__main__":
    main()
