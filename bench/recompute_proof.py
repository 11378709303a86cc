"""The launched proof of the per-stage recompute plan: the partition and each stage's recompute chosen together under
a memory limit (partition/recompute_plan.py), its predicted iteration time and per-stage peaks against a launch of
it, and its measured speed against the recompute people would otherwise use.

    python bench/recompute_proof.py                    # the fork, pp 2 and 4
    python bench/recompute_proof.py --upstream DIR --upstream-python PY   # and upstream's, pp 2
    python bench/recompute_proof.py --cases fork2 upstream2 ...          # some of the cases
    python bench/recompute_proof.py --quick            # the tiny GPT, fork, pp 2: a smoke run
    python bench/recompute_proof.py --rounds 3 ...     # each plan and baseline launched 3 times, interleaved

For each case (a pretrain_gpt.py at a pipeline size), two starting runs under the default partition, profiled at
step 3 (train-iters 3 + 5, as partition_proof.py's default launches): one with no recompute, one with every layer
recomputed (--checkpoint-activations). From the no-recompute run's report, a memory limit L halfway between the least
largest peak any partition reaches with every recomputable layer recomputed and the largest peak of the time-optimal
plan with none recomputed. Where the shape leaves no room between them (the LM head alone sets the largest peak, and
no recompute lowers it), the case moves to the next, lighter vocabulary of its list (SHAPES) and says so.

Then, each launched for 9 iterations profiled at the last (partition_proof.py's planned launches):
- the plan under L from each starting run's report (--pp-partition-from-profile THAT --pp-partition-memory-limit L:
  its recompute_plan, parts and per-stage recompute), against that report's prediction; one launch serves both
  where they plan the same parts and recompute;
- (a) every layer recomputed (--checkpoint-activations) with the best partition (--pp-partition-from-profile of the
  recompute starting run, no limit), against that report's plan;
- (b) the best uniform recompute that fits: every stage recomputing the same N >= 1 (--pp-recompute-layers N,N,...,
  Megatron-LM's --recompute-method block --recompute-num-layers N), launched with --pp-partition-from-profile of the
  no-recompute run and --pp-partition-memory-limit L: with --pp-recompute-layers given, the cut is the plain plan
  under L, chosen as if nothing recomputed (partition/method.py cut_by), so N is the smallest that fits by
  prediction (recompute_what_if) on those parts. No flag asks for an explicit partition; the fastest uniform-N
  partition that fits, found over every partition by prediction, is printed beside it;
- (c) no recompute with the best partition that fits (--pp-recompute-layers 0,0,... with the limit), where the plain
  plan under L fits by prediction.

With --rounds R, the plans' and baselines' launches are repeated R times, interleaved, and each is compared by the
median of its launches' medians (the machine's drift between launches falls on every one alike); peaks and what ran
are the first round's. What each launch ran is read from its report (partition_plan.current_parts and the layers'
recompute FLOPs) and printed. Errors are predicted / measured - 1; one over 10% (partition_proof.py's bar) is in
bold and listed at the end, as is any stage of a launch planned under L whose measured peak (torch's allocator)
exceeds it.
"""
import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import List, Optional

# A script: its own directory is on sys.path, so the siblings import by name.
import partition_proof as proof
import partition_speedup as speedup
from harness import machine

from patches.partition.report_plan import PlanRequest, plan_of
from patches.partition.report_recompute import recomputable_rows, recompute_what_if

CHECKPOINT = ["--checkpoint-activations"]
START_STEP = 3
# each target's shapes, in the order tried: the next where a shape leaves no room for a limit
SHAPES = {
    "fork": [speedup.UNBALANCED, proof.LIMIT_SHAPE, dict(speedup.UNBALANCED, vocab=1024)],
    "upstream": [dict(speedup.UPSTREAM_SHAPE, vocab=speedup.GPT2_VOCAB), dict(speedup.UPSTREAM_SHAPE, vocab=6000)],
}
QUICK_SHAPES = {
    "fork": [speedup.TINY, dict(speedup.TINY, vocab=256)],
    "upstream": [dict(speedup.UPSTREAM_QUICK, vocab=speedup.GPT2_VOCAB), dict(speedup.UPSTREAM_QUICK, vocab=6000)],
}
CASES = {"fork2": ("fork", 2), "upstream2": ("upstream", 2), "fork4": ("fork", 4)}


# ---------------------------------------------------------------- targets and launches
@contextlib.contextmanager
def vocabulary(size):
    """upstream_target grows the demo's BPE vocabulary to speedup.GPT2_VOCAB entries: another size for one call (the
    demo's own 6,000: ids past them are never produced, so the corpus is the same)."""
    saved = speedup.GPT2_VOCAB
    speedup.GPT2_VOCAB = size
    try:
        yield
    finally:
        speedup.GPT2_VOCAB = saved


def target_for(name, shape, args, work):
    if name == "fork":
        return speedup.fork_target(shape)
    folder = work / f"upstream_vocab{shape['vocab']}"
    folder.mkdir(parents=True, exist_ok=True)
    with vocabulary(shape["vocab"]):
        return speedup.upstream_target(args.upstream, args.upstream_python, shape, folder)


def launch(case, flags, iterations, step, out, work):
    """proof.run; None (and the failure's last lines printed) where the launch fails."""
    try:
        return proof.run(case, flags, iterations, step, out, work)
    except SystemExit as failure:
        print(f"  {out}: FAILED ({' '.join(flags)}):\n" + "\n".join(str(failure).splitlines()[-12:]), flush=True)
        return None


def recomputed_layers(report):
    """The layers that recomputed in the run, per stage, from the layer table's recompute FLOPs."""
    stages = len(report["stages"])
    return [[row["index"] for row in report["layers"] if row["stage"] == s and row["recompute_flops"]]
            for s in range(stages)]


def ran_counts(report):
    return [len(layers) for layers in recomputed_layers(report)]


def what_ran(run):
    plan, layers = run.report["partition_plan"], recomputed_layers(run.report)
    per_stage = "; ".join(f"stage {s}: " + (", ".join(map(str, ids)) if ids else "none")
                          for s, ids in enumerate(layers))
    return f"parts {plan['current_parts']}, layers recomputed, per stage: {per_stage}"


@dataclass
class Settings(proof.Settings):
    rounds: int = 1  # launches of each plan and baseline, interleaved


class Launched:
    """The launches of one plan or baseline over the rounds: the median of their medians; the first's report (its
    parts, recompute and peaks: the same in every round)."""

    def __init__(self, runs):
        self.runs = runs
        self.report, self.parts = runs[0].report, runs[0].parts
        self.measured_ms = statistics.median(run.measured_ms for run in runs)

    def medians(self):
        return " ".join(f"{run.measured_ms:.0f}" for run in self.runs)


# ---------------------------------------------------------------- predictions
def limit_bounds(report):
    """(least, its parts, highest): the least largest peak any partition reaches with every recomputable layer
    recomputed (the joint plan under a 1-byte limit fits nowhere and returns that partition with its excess), and the
    largest peak of the time-optimal plan with none recomputed (the report's own plan: no limit on CPU)."""
    floor = plan_of(report, PlanRequest(limit=1, limit_source="flag"))["recompute_plan"]
    return floor["memory_excess_bytes"] + 1, floor["parts"], max(report["partition_plan"]["predicted_peak_bytes"])


def planned_under(report, limit):
    """What a launch with --pp-partition-from-profile REPORT --pp-partition-memory-limit LIMIT (no recompute flag)
    runs, by the report: its recompute plan where that fits, else the plain plan with no recompute (cut_by)."""
    plan = plan_of(report, PlanRequest(limit=limit, limit_source="flag"))
    chosen = plan["recompute_plan"]
    if chosen is not None and chosen["memory_fits"]:
        return dict(chosen, note="")
    pp = len(plan["parts"]) - 1
    return {"parts": plan["parts"], "recompute_layers": [0] * pp, "predicted_iter_s": plan["predicted_iter_s"],
            "predicted_change": plan["predicted_change"], "predicted_peak_bytes": plan["predicted_peak_bytes"],
            "memory_fits": plan["memory_fits"],
            "note": "the recompute plan does not fit: the launch runs the plain plan"}


def every_partition(layers, pp):
    for cuts in combinations(range(1, layers), pp - 1):
        yield [0, *cuts, layers]


def most_recomputable(report, parts):
    able = recomputable_rows(sorted(report["layers"], key=lambda row: row["index"]))
    return max(sum(able[first:stop]) for first, stop in zip(parts, parts[1:]))


def uniform_on(report, parts, limit):
    """(N, what-if): the smallest N >= 1 whose uniform recompute fits on these parts by prediction; the what-if of the
    most recompute where none fits."""
    pp, most = len(parts) - 1, most_recomputable(report, parts)
    for count in range(1, most + 1):
        what = recompute_what_if(report, parts, [count] * pp, limit)
        if what["memory_fits"]:
            return count, what
    return most, recompute_what_if(report, parts, [most] * pp, limit)


def best_uniform(report, limit, pp):
    """(N, what-if) of the fastest uniform recompute (N >= 1 on every stage) over every partition that fits by
    prediction; None where none does."""
    layers, best = len(report["layers"]), None
    for parts in every_partition(layers, pp):
        for count in range(1, most_recomputable(report, parts) + 1):
            what = recompute_what_if(report, parts, [count] * pp, limit)
            if what["memory_fits"]:
                if best is None or what["predicted_iter_s"] < best[1]["predicted_iter_s"]:
                    best = (count, what)
                break  # more recompute on the same parts is only slower
    return best


def same_report_ratios(none, every, chosen, a, b, c):
    """The plan's predicted time over each baseline's, both predicted by one report (the plan's), for the parts and
    recompute each baseline ran: {(the plan's starting run, baseline): ratio}."""
    ratios = {}
    for start, what in ((none, "no-recompute"), (every, "recompute")):
        plan = chosen[what]
        for name, row in (("(a)", a), ("(b)", b), ("(c)", c)):
            if row is None or row.run is None:
                continue
            parts = row.run.report["partition_plan"]["current_parts"]
            other = recompute_what_if(start.report, parts, ran_counts(row.run.report))
            ratios[what, name] = plan["predicted_iter_s"] / other["predicted_iter_s"]
    return ratios


# ---------------------------------------------------------------- rows
@dataclass
class Row:
    """A launch of a case beside the prediction of the report that planned it."""
    label: str
    planned_parts: List[int]
    planned_counts: Optional[List[int]]  # None: the run's own (a starting run)
    predicted_ms: float
    predicted_peaks: List[Optional[int]]
    run: Optional[proof.Run]
    under_limit: bool  # planned under L: its measured peaks are held to it
    start: Optional[proof.Run] = None  # the starting run whose report predicted it
    predicted_change: Optional[float] = None
    note: str = ""

    @property
    def measured_change(self):
        if self.run is None or self.start is None or self.predicted_change is None:
            return None
        return self.run.measured_ms / self.start.measured_ms - 1

    def measured_peaks(self):
        return proof.stage_peaks(self.run.report, "measured_peak_bytes") if self.run else [None] * len(
            self.predicted_peaks)

    def within(self, limit):
        peaks = self.measured_peaks()
        return all(p is not None and p <= limit for p in peaks) if self.run else None


def start_row(label, run):
    own = plan_of(run.report, PlanRequest(parts=run.parts))
    return Row(label, run.parts, None, own["predicted_iter_s"] * 1000,
               proof.stage_peaks(run.report, "predicted_peak_bytes"), run, False)


def planned_row(label, chosen, run, start):
    return Row(label, chosen["parts"], list(chosen["recompute_layers"]), chosen["predicted_iter_s"] * 1000,
               chosen["predicted_peak_bytes"], run, True, start, chosen["predicted_change"], chosen.get("note", ""))


@dataclass
class CaseResult:
    name: str
    pp: int
    shape: dict
    shape_note: str
    limit: int
    least: int
    least_parts: List[int]
    highest: int
    rows: List[Row]
    plan_rows: List[Row]  # the plans from each starting run
    a: Optional[Row]
    b: Optional[Row]
    c: Optional[Row]
    best_b: Optional[tuple]
    predicted_ratios: dict  # (plan's report, baseline) -> the plan's predicted time over the baseline's, one report
    rounds: int
    seconds: float


def prove_case(name, pp, args, settings, work):
    """The starting runs (trying the shapes until one leaves room for a limit), the plans under L and the
    baselines."""
    started = time.perf_counter()
    shapes = (QUICK_SHAPES if args.quick else SHAPES)[name]
    notes = []
    for shape in shapes:
        target = target_for(name, shape, args, work)
        case = proof.Case(name, target, shape, pp, "off")
        label = f"{name}_pp{pp}_vocab{shape['vocab']}"
        print(f"{target.name}: pp {pp}, shape {shape}", flush=True)
        none = launch(case, [], START_STEP + settings.after, START_STEP, f"{label}_start_none", work)
        if none is None:
            raise SystemExit(f"the no-recompute starting run of {name} pp {pp} failed")
        least, least_parts, highest = limit_bounds(none.report)
        print(f"  what ran: {what_ran(none)}", flush=True)
        print(f"  bounds: least largest peak with every layer recomputed {proof.megabytes(least)} MB "
              f"({least_parts}); time-optimal plan with none recomputed {proof.megabytes(highest)} MB "
              f"({none.report['partition_plan']['parts']})", flush=True)
        if least < highest:
            break
        notes.append(f"vocabulary {shape['vocab']} leaves no room (least {proof.megabytes(least)} MB >= "
                     f"time-optimal {proof.megabytes(highest)} MB)")
        print(f"  no room for a limit at vocabulary {shape['vocab']}: trying the next shape", flush=True)
    else:
        raise SystemExit(f"{name} pp {pp}: no shape of {shapes} leaves room for a limit")
    limit = (least + highest) // 2
    print(f"  memory limit L = {limit} bytes ({proof.megabytes(limit)} MB)", flush=True)
    every = launch(case, CHECKPOINT, START_STEP + settings.after, START_STEP, f"{label}_start_all", work)
    if every is None:
        raise SystemExit(f"the recompute starting run of {name} pp {pp} failed")
    print(f"  what ran: {what_ran(every)}", flush=True)
    rows = [start_row("start: no recompute, default partition", none),
            start_row("start: every layer recomputed, default partition", every)]
    n = settings.planned_iterations
    limit_flags = ["--pp-partition-memory-limit", str(limit)]
    launches = {}  # what to launch, each round: key -> flags

    # the plan under L from each starting run (one launch where both plan the same)
    chosen = {}
    for start, what in ((none, "no-recompute"), (every, "recompute")):
        chosen[what] = planned_under(start.report, limit)
        plan = chosen[what]
        key = ("plan", tuple(plan["parts"]), tuple(plan["recompute_layers"]))
        print(f"  plan under L from the {what} run: parts {plan['parts']}, recompute {plan['recompute_layers']}, "
              f"predicted {plan['predicted_iter_s'] * 1000:.1f} ms, peaks "
              f"{[proof.megabytes(p) for p in plan['predicted_peak_bytes']]} MB {plan['note']}", flush=True)
        if key in launches:
            print("  the same parts and recompute as the plan from the no-recompute run: its launch serves both",
                  flush=True)
        else:
            launches[key] = (["--pp-partition-from-profile", str(start.path)] + limit_flags, f"plan_from_{what}")
    # (a) every layer recomputed, the best partition
    launches["a"] = (CHECKPOINT + ["--pp-partition-from-profile", str(every.path)], "a_all_recomputed")
    # (b) uniform N on the plain plan under L (what --pp-recompute-layers with the limit cuts)
    plain = plan_of(none.report, PlanRequest(limit=limit, limit_source="flag"))
    count, what_b = uniform_on(none.report, plain["parts"], limit)
    best_b = best_uniform(none.report, limit, pp)
    print(f"  (b): the plain plan under L cuts {plain['parts']} (fits with nothing recomputed, predicted: "
          f"{plain['memory_fits']}); uniform N = {count} fits there by prediction: {what_b['memory_fits']}; the "
          f"fastest uniform N over every partition: " +
          (f"N = {best_b[0]} on {best_b[1]['parts']}, {best_b[1]['predicted_iter_s'] * 1000:.1f} ms" if best_b
           else "none fits"), flush=True)
    uniform = ",".join([str(count)] * pp)
    launches["b"] = (["--pp-partition-from-profile", str(none.path)] + limit_flags + ["--pp-recompute-layers", uniform],
                     f"b_uniform{count}")
    # (c) no recompute, the best partition within L, where one fits
    if plain["memory_fits"]:
        launches["c"] = (["--pp-partition-from-profile", str(none.path)] + limit_flags +
                         ["--pp-recompute-layers", ",".join(["0"] * pp)], "c_no_recompute")
    else:
        print(f"  (c): no partition fits L with nothing recomputed (the closest exceeds it by "
              f"{proof.megabytes(plain['memory_excess_bytes'])} MB): not launched", flush=True)
    # the rounds, interleaved so that the machine's drift falls on every launch alike
    runs = {key: [] for key in launches}
    for round_ in range(settings.rounds):
        for key, (flags, out) in launches.items():
            launched = launch(case, flags, n, n, f"{label}_{out}_round{round_}", work)
            if launched is not None:
                runs[key].append(launched)
                if round_ == 0:
                    print(f"  what ran: {what_ran(launched)}", flush=True)

    def measured(key):
        return Launched(runs[key]) if runs[key] else None

    plan_rows = []
    for start, what in ((none, "no-recompute"), (every, "recompute")):
        plan = chosen[what]
        key = ("plan", tuple(plan["parts"]), tuple(plan["recompute_layers"]))
        shared = what == "recompute" and launches[key][1] == "plan_from_no-recompute"
        plan_rows.append(planned_row(f"plan under L, from the {what} run" +
                                     (" (the launch of the other's plan)" if shared else ""), plan, measured(key),
                                     start))
    plan_a = every.report["partition_plan"]
    a = Row("(a) every layer recomputed, best partition", plan_a["parts"],
            [most_recomputable(every.report, [first, stop]) for first, stop in zip(plan_a["parts"],
                                                                                   plan_a["parts"][1:])],
            plan_a["predicted_iter_s"] * 1000, plan_a["predicted_peak_bytes"], measured("a"), False, every,
            plan_a["predicted_change"])
    b = planned_row(f"(b) uniform N = {count} (--pp-recompute-layers {uniform})", what_b, measured("b"), none)
    c = None
    if "c" in launches:
        c = Row("(c) no recompute, best partition within L", plain["parts"], [0] * pp,
                plain["predicted_iter_s"] * 1000, plain["predicted_peak_bytes"], measured("c"), True, none,
                plain["predicted_change"])
    predicted_ratios = same_report_ratios(none, every, chosen, a, b, c)
    rows += plan_rows + [a, b] + ([c] if c else [])
    result = CaseResult(name, pp, shape, "; ".join(notes), limit, least, least_parts, highest, rows, plan_rows, a, b,
                        c, best_b, predicted_ratios, settings.rounds, time.perf_counter() - started)
    print_case(result)
    return result


# ---------------------------------------------------------------- printing
def counts_cell(row):
    if row.run is None:
        return "(not run)"
    ran = ran_counts(row.run.report)
    text = ",".join(map(str, ran))
    if row.planned_counts is not None and list(row.planned_counts) != ran:
        text += f" (planned {','.join(map(str, row.planned_counts))})"
    return text


def parts_cell(row):
    if row.run is None:
        return f"{row.planned_parts} (launch failed)"
    ran = row.run.report["partition_plan"]["current_parts"]
    return f"{ran}" + ("" if ran == row.planned_parts else f" (planned {row.planned_parts})")


def change_cell(row):
    if row.measured_change is None:
        return ""
    return f"{row.predicted_change:+.1%} / {row.measured_change:+.1%}"


def within_cell(row, limit):
    within = row.within(limit)
    if within is None:
        return "n/a"
    text = "yes" if within else "no"
    return f"**{text}**" if row.under_limit and not within else text


def ratio(row, other):
    if row.run is None or other is None or other.run is None:
        return None
    return row.run.measured_ms / other.run.measured_ms


def ratio_text(value, name):
    if value is None:
        return f"vs {name}: n/a"
    word = "faster" if value < 1 else "slower"
    return f"vs {name}: x{value:.3f} of its median ({abs(1 - value):.1%} {word})"


def short_label(row):
    return row.label[:3] if row.label.startswith("(") else row.label.replace("plan under L, from the", "plan from")


def print_case(result):
    pp = result.pp
    print(f"\n### {result.name}, pp {pp}\n")
    print(f"shape {result.shape}" + (f" ({result.shape_note}: moved to this one)" if result.shape_note else ""))
    print(f"memory limit L = {proof.megabytes(result.limit)} MB: halfway between the least largest peak with every "
          f"recomputable layer recomputed, {proof.megabytes(result.least)} MB ({result.least_parts}), and the "
          f"time-optimal plan's with none recomputed, {proof.megabytes(result.highest)} MB (both predicted from the "
          f"no-recompute starting run)\n")
    headers = ["launch", "parts", "recompute per stage (ran)", "predicted ms", "measured median ms", "error",
               "change from its starting run, predicted / measured"] + \
        [f"stage {s} peak MB, predicted / measured (error)" for s in range(pp)] + ["within L (measured)"]
    lines = []
    for row in result.rows:
        measured_ms = row.run.measured_ms if row.run else None
        lines.append([row.label + (f" ({row.note})" if row.note else ""), parts_cell(row), counts_cell(row),
                      f"{row.predicted_ms:.1f}", f"{measured_ms:.1f}" if measured_ms else "n/a",
                      proof.percent(proof.error(row.predicted_ms, measured_ms)), change_cell(row)]
                     + [proof.peak_cell(p, m) for p, m in zip(row.predicted_peaks, row.measured_peaks())]
                     + [within_cell(row, result.limit)])
    print(proof.markdown(headers, lines))
    print()
    for row, what in zip(result.plan_rows, ("no-recompute", "recompute")):
        against = [(name, other) for name, other in (("(a)", result.a), ("(b)", result.b), ("(c)", result.c))
                   if other is not None]
        print(f"- {row.label}: within L on every stage (measured): {'yes' if row.within(result.limit) else 'NO'}; "
              + "; ".join(f"{ratio_text(ratio(row, other), name)}, predicted x"
                          + (f"{result.predicted_ratios[what, name]:.3f}" if (what, name) in result.predicted_ratios
                             else "n/a") for name, other in against))
    if result.rounds > 1:
        print("- each launch's median by round (ms): " + "; ".join(
            f"{short_label(row)}: {row.run.medians()}"
            for row in result.rows[2:] if row.run is not None and "the launch of the other" not in row.label))
    if result.best_b:
        count, what = result.best_b
        print(f"- the fastest uniform recompute over every partition, by prediction: N = {count} on {what['parts']}, "
              f"{what['predicted_iter_s'] * 1000:.1f} ms (b ran {result.b.planned_parts}, predicted "
              f"{result.b.predicted_ms:.1f} ms)")
    print(f"- {result.seconds:.0f} s for this case", flush=True)


def over_the_bar(results):
    lines = []
    for result in results:
        for row in result.rows:
            if row.run is None:
                lines.append(f"{result.name} pp {result.pp}, {row.label}: the launch failed")
                continue
            where = f"{result.name} pp {result.pp}, {row.label}"
            time_error = proof.error(row.predicted_ms, row.run.measured_ms)
            if time_error is not None and abs(time_error) > proof.BAR:
                lines.append(f"{where}: iteration time {time_error:+.1%}")
            for stage, (p, m) in enumerate(zip(row.predicted_peaks, row.measured_peaks())):
                peak_error = proof.error(p, m)
                if peak_error is not None and abs(peak_error) > proof.BAR:
                    lines.append(f"{where}: stage {stage} peak {peak_error:+.1%}")
                if row.under_limit and (m is None or m > result.limit):
                    lines.append(f"{where}: stage {stage} measured {proof.megabytes(m)} MB over L "
                                 f"{proof.megabytes(result.limit)} MB")
    return lines


# ---------------------------------------------------------------- main
def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=None,
                        help="default: fork2 upstream2 fork4 (upstream2 with --upstream)")
    parser.add_argument("--quick", action="store_true", help="the tiny GPT, pp 2, shorter launches")
    parser.add_argument("--rounds", type=int, default=1,
                        help="launches of each plan and baseline, interleaved; their median is compared (default 1)")
    parser.add_argument("--upstream", metavar="DIR", help="an upstream Megatron-DeepSpeed checkout to run too")
    parser.add_argument("--upstream-python", metavar="PY", default=sys.executable,
                        help="the interpreter of the environment upstream runs in (default: this one)")
    parser.add_argument("--keep", metavar="DIR", type=Path,
                        help="run in DIR and keep every launch's reports and logs there (default: a temporary one)")
    args = parser.parse_args()
    if args.cases is None:
        args.cases = [case for case in CASES if args.upstream or CASES[case][0] == "fork"]
        if args.quick:
            args.cases = [case for case in args.cases if CASES[case][1] == 2]
    if any(CASES[case][0] == "upstream" for case in args.cases) and not args.upstream:
        parser.error("an upstream case needs --upstream")
    return args


def main():
    args = parse()
    settings = Settings(after=4, planned_iterations=5, rounds=args.rounds) if args.quick else \
        Settings(after=5, planned_iterations=9, rounds=args.rounds)
    print(machine(), flush=True)
    start = time.perf_counter()
    results = []
    with (contextlib.nullcontext(str(args.keep)) if args.keep
          else tempfile.TemporaryDirectory(prefix="recompute_proof_")) as work:
        for case in args.cases:
            name, pp = CASES[case]
            results.append(prove_case(name, pp, args, settings, Path(work)))
    proof.print_ending(f"errors over the {proof.BAR:.0%} bar, and peaks over L", over_the_bar(results), start)


if __name__ == "__main__":
    main()
