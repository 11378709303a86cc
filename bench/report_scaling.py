"""What gathering and printing the profile report costs, against pipeline stages and layers.

    python bench/report_scaling.py            # stages 1, 2, 4, 8 (8 layers); layers 4..64 (2 stages)
    python bench/report_scaling.py --quick    # the tiniest GPT: stages 1, 2; layers 2, 4
    deepspeed --num_gpus N bench/report_scaling.py [--quick]   # one stage count (N), layers at N stages

For every point: build the GPT pipeline, run plain iterations, profile one (three by default, medians),
then time (slowest rank, between barriers) what follows the profiled iteration: get_report (every rank's module tree and
instruction timings all-gathered, the report built), print_model_profile (rank 0 formats the whole
text report; written to a file, so a terminal's speed is not measured), write_json, end_profile.
The cost should grow linearly with the number of module nodes and stay a small share of one
iteration. With more ranks than cores (8 stages on 2 cores) every rank waits for a core: those rows
show the machine as much as the profiler.
"""
import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

# A script: its own directory is on sys.path, so the sibling harness imports by name.
from harness import (TINY, build_pipeline_engine, init_megatron, launched, load, machine, median,
                           spawn, table, timed)

# A GPT small enough for 64 layers on 2 cores; 8 micro-batches keep an 8-stage pipeline busy.
SCALING = {"hidden": 128, "heads": 4, "layers": 8, "seq": 128, "micro_batch": 2, "micro_batches": 8, "vocab": 1024}
STAGES, LAYERS, LAYER_SWEEP_STAGES = (1, 2, 4, 8), (4, 8, 16, 32, 64), 2
QUICK_STAGES, QUICK_LAYERS = (1, 2), (2, 4)  # the layer sweep runs on 2 stages in both


def count_nodes(node):
    return 1 + sum(count_nodes(child) for child in node["children"])


def measure_point(args, layers, repeats, out_dir):
    """One row: the report's costs (medians over `repeats` profiled iterations) for the GPT with
    `layers` layers on this world's pipeline."""
    # The sweep rebuilds the model in the same process group: the model provider reads the layer
    # count from the global args.
    args.num_layers = layers
    engine, step = build_pipeline_engine(args)
    step()  # warm-up
    plain_s = median([timed(step)[0] for _ in range(3)])
    costs = [profile_and_report(engine, step, args, out_dir) for _ in range(repeats)]
    row = {key: median([cost[key] for cost in costs]) for key in costs[0]}
    row.update(stages=dist.get_world_size(), layers=layers, plain_s=plain_s, modules=costs[0]["modules"])
    del engine, step
    gc.collect()
    return row


def profile_and_report(engine, step, args, out_dir):
    from megatron.profiler import PipelineFlopsProfiler

    profiler = PipelineFlopsProfiler(engine, seq_length=args.seq_length)

    def profiled():
        profiler.start_profile()
        step()
        profiler.stop_profile()

    profiled_s, _ = timed(profiled)
    gather_s, report = timed(profiler.get_report)
    print_s, _ = timed(lambda: profiler.print_model_profile(output_file=os.path.join(out_dir, "report.txt")))
    json_s, _ = timed(lambda: profiler.write_json(os.path.join(out_dir, "report.json")))
    end_s, _ = timed(profiler.end_profile)
    return {"modules": sum(count_nodes(stage["modules"]) for stage in report["stages"]), "profiled_s": profiled_s,
            "gather_s": gather_s, "print_s": print_s, "json_s": json_s, "end_s": end_s,
            "report_s": gather_s + print_s + json_s + end_s}


def worker(shape, layer_counts, repeats, result_path=None):
    """Rows for each layer count on this world's pipeline; rank 0 also writes them to result_path."""
    args = init_megatron(shape, int(os.environ["WORLD_SIZE"]))
    out_dir = tempfile.mkdtemp(prefix="report_scaling_")
    rows = [measure_point(args, layers, repeats, out_dir) for layers in layer_counts]
    if result_path and dist.get_rank() == 0:
        with open(result_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    return rows


def ms(seconds):
    return f"{seconds * 1000:.1f}"


def rows_table(rows):
    headers = ["stages", "layers", "module nodes", "gather+build ms", "print ms", "json ms", "end ms",
               "total ms", "us per node", "iteration s", "share of iteration"]
    return table(headers, [[r["stages"], r["layers"], r["modules"], ms(r["gather_s"]), ms(r["print_s"]),
                            ms(r["json_s"]), ms(r["end_s"]), ms(r["report_s"]),
                            f"{r['report_s'] / r['modules'] * 1e6:.0f}", f"{r['plain_s']:.3f}",
                            f"{100 * r['report_s'] / r['plain_s']:.2f}%"] for r in rows])


def print_tables(shape, layer_rows, stage_rows):
    print(f"machine: {machine()}")
    print(f"config: hidden {shape['hidden']}, {shape['heads']} heads, sequence {shape['seq']}, micro-batch "
          f"{shape['micro_batch']}, {shape['micro_batches']} micro-batches, vocabulary {shape['vocab']}, fp32")
    print("report cost = get_report (all-gather + build) + print_model_profile (to a file) + write_json + "
          "end_profile; slowest rank between barriers; iteration = median plain train_batch")
    print(f"\nreport cost against pipeline stages ({shape['layers']} layers):")
    print(rows_table(stage_rows))
    print(f"\nreport cost against layers ({layer_rows[0]['stages'] if layer_rows else '-'} stages):")
    print(rows_table(layer_rows))
    for name, rows, size in (("stages", stage_rows, "stages"), ("layers", layer_rows, "modules")):
        if len(rows) > 1:
            fixed, slope, worst = linear_fit([r[size] for r in rows], [r["report_s"] for r in rows])
            unit = "rank" if size == "stages" else "module node"
            print(f"fit against {name}: report cost = {fixed * 1e3:.1f} ms + {slope * 1e3:.3f} ms per {unit} "
                  f"(largest deviation from the line: {worst * 1e3:.1f} ms)")


def linear_fit(xs, ys):
    """Least squares y = a + b x; returns a, b and the largest |residual|."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    fixed = mean_y - slope * mean_x
    return fixed, slope, max(abs(y - fixed - slope * x) for x, y in zip(xs, ys))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiniest GPT, stages 1-2, layers 2-4 (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3, help="profiled iterations per point (default 3; medians)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    options = parser.parse_args()
    shape = dict(TINY if options.quick else SCALING)
    stage_counts = QUICK_STAGES if options.quick else STAGES
    layer_counts = QUICK_LAYERS if options.quick else LAYERS
    repeats = 1 if options.quick else options.repeats
    if launched():
        # The launcher fixed the world: its stage count, and the layer sweep on it.
        world = int(os.environ["WORLD_SIZE"])
        if world > shape["layers"]:
            raise SystemExit(f"error: {world} stages need at least {world} layers; this sweep has {shape['layers']}")
        rows = worker(shape, sorted({n for n in layer_counts if n >= world} | {shape["layers"]}), repeats)
        if dist.get_rank() == 0:
            print_tables(shape, [r for r in rows if r["layers"] in layer_counts],
                         [r for r in rows if r["layers"] == shape["layers"]])
        return
    with tempfile.TemporaryDirectory() as tmp:
        stage_rows, layer_rows = [], []
        for stages in stage_counts:
            sweep = layer_counts if stages == LAYER_SWEEP_STAGES else ()
            path = os.path.join(tmp, f"stages{stages}.json")
            spawn(worker, stages, shape, sorted(set(sweep) | {shape["layers"]}), repeats, path)
            with open(path) as f:
                rows = json.load(f)
            stage_rows += [r for r in rows if r["layers"] == shape["layers"]]
            layer_rows += [r for r in rows if r["layers"] in sweep]
        print_tables(shape, layer_rows, stage_rows)
        print(f"at the end: {load()}")

if __name__ == "__main__":
    main()
