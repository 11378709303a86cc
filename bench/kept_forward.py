"""What keeping a layer's activations costs its forward on this machine, beside recomputing them: why a plan priced
from a run without recompute overprices the recompute on a CPU.

A run without recompute measures each transformer layer's forward with autograd, every micro-batch's activations
kept until its backward; the plan prices a checkpointed forward (no autograd) and a recompute at that forward
(report_recompute._both_ways_s). Here one transformer layer (torch.nn.TransformerEncoderLayer, dropout off) runs
`--layers` deep for `--in-flight` micro-batches both ways, one thread, as a pipeline stage's 1F1B warm-up does:

- kept whole: every forward with autograd, then every backward;
- recomputed: every forward without autograd (its input kept), then for each micro-batch, last layer first, the
  forward again with autograd (the recompute) and its backward at once.

Printed per shape: the medians over `--repeats` (the first two dropped) of each part, in ms for all the layers and
micro-batches, with the thread's system time and minor page faults (getrusage, RUSAGE_THREAD) over each part:
where the kept forward's excess over the checkpointed one is kernel time (page faults of fresh memory) or not.

    python bench/kept_forward.py [--in-flight 2 4] [--repeats 10]
    python bench/kept_forward.py --quick      # 2 layers, 2 in flight, 3 repeats (tests/test_bench_smoke.py)
"""
import argparse
import resource
import statistics
import time

import torch

# (hidden, heads, sequence, micro-batch): the recompute proof's fork and upstream shapes (docs/benchmarks.md part 13)
SHAPES = {"fork (hidden 128, seq 128, micro-batch 4)": (128, 4, 128, 4),
          "upstream (hidden 64, seq 512, micro-batch 1)": (64, 4, 512, 1)}


class Part:
    """One part's wall time, the thread's system time and its minor page faults, summed over its calls."""

    def __init__(self):
        self.wall_s = self.system_s = self.faults = 0.0

    def run(self, function, *args):
        usage, start = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
        result = function(*args)
        wall, after = time.perf_counter(), resource.getrusage(resource.RUSAGE_THREAD)
        self.wall_s += wall - start
        self.system_s += after.ru_stime - usage.ru_stime
        self.faults += after.ru_minflt - usage.ru_minflt
        return result


def kept_whole(layer, inputs, depth):
    forward, backward = Part(), Part()
    outputs = []
    for x in inputs:
        y = x.requires_grad_(True)
        for _ in range(depth):
            y = forward.run(layer, y)
        outputs.append(y)
    for y in outputs:
        backward.run(lambda y=y: y.sum().backward())
    return forward, backward


def recomputed(layer, inputs, depth):
    forward, recompute, backward = Part(), Part(), Part()
    checkpoints = []
    for x in inputs:
        kept, y = [], x
        for _ in range(depth):
            kept.append(y)
            with torch.no_grad():
                y = forward.run(layer, y)
        checkpoints.append(kept)
    for kept in checkpoints:
        grad = torch.ones_like(kept[0])
        for x in reversed(kept):
            x = x.detach().requires_grad_(True)
            y = recompute.run(layer, x)
            backward.run(lambda y=y, grad=grad: y.backward(grad))
            grad = x.grad
    return forward, recompute, backward


def median_ms(runs, index, field):
    return 1e3 * statistics.median(getattr(run[index], field) for run in runs[2:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="2 layers, 2 micro-batches in flight, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.in_flight, args.repeats = 2, [2], 3
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for name, (hidden, heads, sequence, micro_batch) in SHAPES.items():
        layer = torch.nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, batch_first=True)
        for in_flight in args.in_flight:
            inputs = [torch.randn(micro_batch, sequence, hidden) for _ in range(in_flight)]
            kept = [kept_whole(layer, [x.clone() for x in inputs], args.layers) for _ in range(args.repeats)]
            again = [recomputed(layer, inputs, args.layers) for _ in range(args.repeats)]
            whole = median_ms(kept, 0, "wall_s") + median_ms(kept, 1, "wall_s")
            both = sum(median_ms(again, index, "wall_s") for index in range(3))
            ratio = median_ms(again, 0, "wall_s") / median_ms(kept, 0, "wall_s")
            print(f"{name}, {args.layers} layers, {in_flight} micro-batches in flight:\n"
                  f"  kept whole: forward {median_ms(kept, 0, 'wall_s'):.1f} ms (system "
                  f"{median_ms(kept, 0, 'system_s'):.1f} ms, {median_ms(kept, 0, 'faults') / 1e3:.0f} faults), "
                  f"backward {median_ms(kept, 1, 'wall_s'):.1f} ms\n"
                  f"  recomputed: forward without autograd {median_ms(again, 0, 'wall_s'):.1f} ms, recompute "
                  f"{median_ms(again, 1, 'wall_s'):.1f} ms, backward {median_ms(again, 2, 'wall_s'):.1f} ms\n"
                  f"  the checkpointed forward / the kept one: x{ratio:.2f}; "
                  f"recomputing adds {both - whole:+.1f} ms, the plan from a run without recompute prices it at "
                  f"+{median_ms(kept, 0, 'wall_s'):.1f} ms (one kept forward)")


if __name__ == "__main__":
    main()
