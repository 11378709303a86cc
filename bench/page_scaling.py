"""The profile page of a large run: its size and how long headless Chromium takes to open it and to redraw the
what-if, for a report of 4,096 ranks (pp 16 x tp 8 x dp 32) with 96 transformer layers and 64 micro-batches.

    python bench/page_scaling.py --report demo_output/flops_profile_step3.json     # the demo's (bash tools/demo.sh)
    python bench/page_scaling.py --report R.json --pp 4 --tp 2 --dp 2 --layers 8   # another size

The large report is made from a real run's report and trace (a PipelineModule's, with its layer table and memory):
its transformer layers' rows repeated to the number asked for, cut evenly over the stages; every stage's figures
the real first stage's (the last stage the real last's), its memory's micro-batches in flight 1F1B's; the plan
planned again over them (report_plan.plan_of). Its trace: every stage and tensor rank of replica 0, the schedule
DeepSpeed's 1F1B runs with each instruction the real run's median duration for its kind (a send's or receive's
shortest: the others include waiting). The report's totals, notes and stragglers stay the real run's: the page's
size and drawing depend on the rows, not on those figures.
Opening is timed from navigation to the page's script done (window.profilePage.ready), a what-if redraw from
typing a boundary to its lines printed; medians of `--repeats`.
"""
import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from harness import load, machine

from patches.cli.profile_page import page_html, trace_beside
from patches.partition.report_plan import PlanRequest, plan_of

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.helpers.browser import CHROMIUM_ARGS  # noqa: E402  (the tests' browser flags, one definition)


def scaled_layers(layers, count, pp):
    """The real run's first layer, its transformer layers repeated to `count`, then its layers after them; cut
    evenly over pp stages (the first and last layers with the first and last stage). Returns (rows, parts)."""
    transformers = [row for row in layers if "TransformerLayer" in row["type"]]
    head = [row for row in layers if row["index"] < transformers[0]["index"]]
    tail = [row for row in layers if row["index"] > transformers[-1]["index"]]
    body = [copy.deepcopy(transformers[i % len(transformers)]) for i in range(count)]
    rows = [copy.deepcopy(row) for row in head] + body + [copy.deepcopy(row) for row in tail]
    per_stage = count // pp
    parts = [0] + [len(head) + per_stage * s for s in range(1, pp)] + [len(rows)]
    for index, row in enumerate(rows):
        row["index"] = index
        row["stage"] = max(s for s in range(pp) if parts[s] <= index)
        row["node"] = str(index - parts[row["stage"]])
    return rows, parts


def scaled_report(report, pp, tp, dp, layers, micro_batches):
    big = copy.deepcopy(report)
    first, last = report["stages"][0], report["stages"][-1]
    big["parallelism"].update(world_size=pp * tp * dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                              data_parallel_size=dp, micro_batches=micro_batches)
    big["layers"], parts = scaled_layers(report["layers"], layers, pp)
    big["stages"] = []
    for s in range(pp):
        stage = copy.deepcopy(last if s == pp - 1 else first)
        stage["stage_id"], stage["global_ranks"] = s, [s * tp + t for t in range(tp)]
        stage["memory"]["in_flight_micro_batches"] = min(pp - s, micro_batches)
        big["stages"].append(stage)
    bubble = big.get("bubble") or {}
    rows = bubble.get("stages") or []
    bubble["stages"] = [dict(rows[-1 if s == pp - 1 else 0], stage_id=s) for s in range(pp)] if rows else []
    for key in ("stragglers",):
        stages = (big.get(key) or {}).get("stages") or []
        if stages:
            big[key]["stages"] = [dict(stages[-1 if s == pp - 1 else 0], stage_id=s, replicas=dp) for s in range(pp)]
    overheads = report["partition_plan"]["stage_overhead_s"]
    big["partition_plan"] = dict(report["partition_plan"], current_parts=parts,
                                 stage_overhead_s=[overheads[-1] if s == pp - 1 else overheads[0] for s in range(pp)])
    big["partition_plan"] = plan_of(big, PlanRequest())
    return big


def typical_durations(trace):
    """Each instruction kind's median duration in the real trace; a send's or receive's shortest (the others
    include waiting for the neighbour, which the 1F1B order below adds by itself)."""
    durations = defaultdict(list)
    for event in trace["traceEvents"]:
        if event.get("cat") == "instruction":
            durations[event["args"]["instruction"]].append(event["dur"])
    return {name: min(values) if name.startswith(("Send", "Recv")) else statistics.median(values)
            for name, values in durations.items()}


def _forward(stage, pp, mb):
    receive = [("LoadMicroBatch", mb, None)] if stage == 0 else \
        [("RecvActivation", mb, (stage - 1, "SendActivation", mb))]
    send = [("SendActivation", mb, None)] if stage < pp - 1 else []
    return receive + [("ForwardPass", mb, None)] + send


def _backward(stage, pp, mb):
    receive = [("RecvGrad", mb, (stage + 1, "SendGrad", mb))] if stage < pp - 1 else []
    send = [("SendGrad", mb, None)] if stage > 0 else []
    return receive + [("BackwardPass", mb, None)] + send


def one_f_one_b(pp, micro_batches):
    """Each stage's instructions in DeepSpeed's 1F1B order: (kind, micro-batch, what it waits for: (stage, kind,
    micro-batch) or None)."""
    orders = []
    for stage in range(pp):
        warmup = min(pp - stage - 1, micro_batches)
        order = [step for mb in range(warmup) for step in _forward(stage, pp, mb)]
        for backward in range(micro_batches):
            if warmup + backward < micro_batches:
                order += _forward(stage, pp, warmup + backward)
            order += _backward(stage, pp, backward)
        orders.append(order + [("ReduceGrads", -1, None), ("OptimizerStep", -1, None)])
    return orders


def scaled_trace(trace, pp, tp, micro_batches):
    """Replica 0's trace at this size: 1F1B's order on every stage, each instruction its kind's typical duration."""
    durations = typical_durations(trace)
    ends, clock, events = {}, [0.0] * pp, []
    orders, done = one_f_one_b(pp, micro_batches), [0] * pp
    while any(done[s] < len(orders[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            while done[s] < len(orders[s]):
                kind, mb, after = orders[s][done[s]]
                if after is not None and after not in ends:
                    break
                start = max(clock[s], ends[after] if after is not None else 0.0)
                end = start + durations.get(kind, 1.0)
                ends[s, kind, mb], clock[s] = end, end
                args = {"instruction": kind, **({"micro_batch": mb} if mb >= 0 else {})}
                for t in range(tp):
                    events.append({"name": kind, "cat": "instruction", "ph": "X", "pid": s, "tid": t, "ts": start,
                                   "dur": end - start, "args": args})
                done[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("the 1F1B orders wait on each other")
    names = [{"ph": "M", "name": "process_name", "pid": s, "args": {"name": f"stage {s}"}} for s in range(pp)]
    return {"traceEvents": names + events}


def timed_page(path, repeats):
    """(median seconds to open, median seconds to redraw the what-if) in headless Chromium."""
    from playwright.sync_api import sync_playwright

    opens, redraws = [], []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        for repeat in range(repeats):
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors = []
            page.on("pageerror", lambda error, errors=errors: errors.append(str(error)))
            start = time.perf_counter()
            page.goto(f"file://{path}")
            page.wait_for_function("window.profilePage && window.profilePage.ready")
            opens.append(time.perf_counter() - start)
            if repeat == 0:
                steps = page.evaluate("window.profilePage.timings")
                print("    ms by step: " + ", ".join(f"{name} {ms:.0f}" for name, ms in steps.items()), flush=True)
            boundary = page.locator("section.what-if input.boundary").first
            before = page.inner_text("section.what-if pre.what-if-lines")
            start = time.perf_counter()
            boundary.fill(str(int(boundary.input_value()) + 1 + repeat % 2))
            page.wait_for_function("before => document.querySelector('section.what-if pre.what-if-lines')"
                                   ".textContent !== before", arg=before)
            redraws.append(time.perf_counter() - start)
            if errors:
                raise SystemExit(f"error: the page failed: {errors[0]}")
            page.close()
        browser.close()
    return statistics.median(opens), statistics.median(redraws)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, default=REPO / "demo_output" / "flops_profile_step3.json")
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--dp", type=int, default=32)
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--micro-batches", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not args.report.exists():
        raise SystemExit(f"error: no report at {args.report}: run bash tools/demo.sh first, or give --report")
    print(machine(), flush=True)
    report = json.loads(args.report.read_text())
    trace = json.loads(Path(trace_beside(str(args.report))).read_text())
    rows = []
    with tempfile.TemporaryDirectory(prefix="page_scaling_") as work:
        for label, size in (("the real run", None),
                            (f"pp {args.pp} x tp {args.tp} x dp {args.dp}, {args.layers} layers, "
                             f"{args.micro_batches} micro-batches", args)):
            directory = Path(work) / ("real" if size is None else "large")
            directory.mkdir()
            path = directory / "flops_profile_step3.json"
            if size is None:
                made_report, made_trace = report, trace
            else:
                made_report = scaled_report(report, size.pp, size.tp, size.dp, size.layers, size.micro_batches)
                made_trace = scaled_trace(trace, size.pp, size.tp, size.micro_batches)
            path.write_text(json.dumps(made_report))
            (directory / "pipeline_trace_step3.json").write_text(json.dumps(made_trace))
            start = time.perf_counter()
            html = page_html([str(path)])
            written = time.perf_counter() - start
            page = directory / "page.html"
            page.write_text(html)
            slices = sum(1 for e in made_trace["traceEvents"] if e.get("cat") == "instruction")
            opened, redrawn = timed_page(page, args.repeats)
            rows.append((label, made_report["parallelism"]["world_size"], len(made_report["layers"]), slices,
                         len(html.encode()) / 1e6, written, opened, redrawn))
            print(f"  {label}: done", flush=True)
    print("\n| report | ranks | layers | timeline slices | page MB | made in s | opens in s (median) | "
          "what-if redraw s (median) |\n|---|---|---|---|---|---|---|---|")
    for label, ranks, layers, slices, megabytes, written, opened, redrawn in rows:
        print(f"| {label} | {ranks:,} | {layers} | {slices:,} | {megabytes:.2f} | {written:.2f} | {opened:.2f} | "
              f"{redrawn:.3f} |")
    print(f"\nafter: {load()}")


if __name__ == "__main__":
    main()
