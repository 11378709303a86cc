"""How long the joint plan takes (the partition and each stage's recompute under a memory limit,
patches/partition/recompute_plan.py) as the pipeline grows, up to 96 layers on pp 16.

    python bench/recompute_plan_scaling.py            # 24/4, 48/8, 96/16 layers/stages, 5 repeats each; medians
    python bench/recompute_plan_scaling.py --quick    # 24 layers on pp 4 only

The layer table is a GPT's shape: an embedding, L transformer layers of equal cost and bytes (a few percent of
noise, as measured tables have), a final norm and an LM head four layers heavy; 1F1B's micro-batches in flight,
min(pp - s, m) with m = 2 pp. The limit sits between the largest peak with every layer recomputed and the largest
with none, where the search has the most to weigh. Printed: the median seconds of one plan, what it recomputes
per stage, and the plan's predicted stage times against the fastest with no limit.
"""
import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patches.partition.memory_model import PositionMemory  # noqa: E402
from patches.partition.recompute_plan import RecomputableLayer, plan_recompute  # noqa: E402

MIB = 1 << 20


def gpt_table(layers: int, stages: int, seed: int = 0):
    rng = random.Random(seed)
    jitter = lambda value: value * rng.uniform(0.97, 1.03)  # noqa: E731
    table = [RecomputableLayer(0, jitter(1.0), 0.0, False, 200 * MIB, 16 * MIB, 1 * MIB)]
    table += [RecomputableLayer(i, jitter(3.0), jitter(1.0), True, 400 * MIB, int(jitter(160 * MIB)), 16 * MIB)
              for i in range(1, layers + 1)]
    table += [RecomputableLayer(layers + 1, jitter(0.1), 0.0, False, 1 * MIB, 16 * MIB, 16 * MIB),
              RecomputableLayer(layers + 2, jitter(12.0), 0.0, False, 200 * MIB, 600 * MIB, 16 * MIB)]
    micro_batches = 2 * stages
    positions = [PositionMemory(64 * MIB, 16 * MIB, min(stages - s, micro_batches), 256 * MIB, 512 * MIB,
                                1600 * MIB) for s in range(stages)]
    return table, positions, [0.5] * stages


def one(layers: int, stages: int, repeats: int) -> None:
    table, positions, overheads = gpt_table(layers, stages)
    free = plan_recompute(table, positions, overheads, None)
    every = plan_recompute(table, positions, overheads, 1)  # nothing fits: every layer recomputed, least peak
    least = max(stage.peak_bytes for stage in every.stages)
    most = max(stage.peak_bytes for stage in free.stages)
    limit = (least + most) // 2
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_recompute(table, positions, overheads, limit)
        times.append(time.perf_counter() - start)
    bound = max(stage.seconds for stage in plan.stages)
    free_bound = max(stage.seconds for stage in free.stages)
    print(f"{layers:3d} layers, pp {stages:2d}: {statistics.median(times):.3f} s per plan (median of {repeats}); "
          f"limit {limit / MIB:.0f} MiB (peaks {least / MIB:.0f}-{most / MIB:.0f}); recompute per stage "
          f"{plan.recompute}; bound {bound:.2f} against {free_bound:.2f} without a limit "
          f"(x{bound / free_bound:.3f}); fits: {plan.excess_bytes is None}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for layers, stages in ((24, 4),) if args.quick else ((24, 4), (48, 8), (96, 16)):
        one(layers, stages, args.repeats)


if __name__ == "__main__":
    main()
