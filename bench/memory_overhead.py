"""What measuring the memory adds to the iteration that counts the FLOPs, and how close its predicted peak comes to
the measured one, on a GPT whose LM head outweighs a layer.

    python bench/memory_overhead.py            # spawns 2 ranks (pipeline 2) on CPU
    python bench/memory_overhead.py --reference  # part 1's reference GPT instead (profiler_overhead.py's)
    python bench/memory_overhead.py --quick    # the tiniest GPT, one round: a smoke run

GPT: hidden 128, 8 layers, sequence 128, micro-batch 4, 8 micro-batches, vocabulary 16,384, pipeline 2, fp32,
Adam. Rounds of (plain, counting, counting with the memory measured), interleaved so that a machine shared with
other work slows them alike; "counting" is the iteration before the profiled one (StageMeasurement with its
dispatch mode), its memory measurement swapped out for the first of the two. Every time is the slowest rank's
wall time; CPU time is summed over the ranks (the steadier measure on a shared machine). Then each stage's
memory as the report would show it: the state, the predicted and the measured peak.
"""
import argparse
import contextlib

import torch.distributed as dist

# A script: its own directory is on sys.path, so the sibling harness imports by name.
from harness import (
    REFERENCE,
    TINY,
    build_pipeline_engine,
    init_megatron,
    launched,
    median,
    print0,
    spawn,
    table,
    timed_iteration,
)

LM_HEAD_GPT = {"hidden": 128, "heads": 4, "layers": 8, "seq": 128, "micro_batch": 4, "micro_batches": 8,
               "vocab": 16384}
PIPELINE = 2


class _NoMemory:
    """MemoryMeasurement's stand-in: the counting iteration as it ran before the memory was measured."""

    @classmethod
    def started(cls, *args, **kwargs):
        return cls()

    def instruction_guarded(self, name, buffer_id=None):
        return contextlib.nullcontext()

    def stop(self):
        return None


def _counting(engine, step, memory):
    """One counting iteration (the dispatch mode on), with or without the memory measured; (wall, cpu, memory)."""
    from patches.profiler import measurement as measurement_module

    real = measurement_module.MemoryMeasurement
    measurement_module.MemoryMeasurement = real if memory else _NoMemory
    try:
        counting = measurement_module.StageMeasurement(engine)
        counting.start()
        wall_s, cpu_s, _ = timed_iteration(step)
        counting.detach()
    finally:
        measurement_module.MemoryMeasurement = real
    return wall_s, cpu_s, counting.measured_memory


def worker(shape, rounds):
    import patches
    from patches.formats.units import bytes_to_string
    from patches.partition.memory_model import PositionMemory, stage_peak

    patches.apply()
    args = init_megatron(shape, PIPELINE)
    engine, step = build_pipeline_engine(args)
    for _ in range(2):  # warm-up: Adam's state, the receive buffers
        step()
    times = {"plain": [], "counting": [], "counting + memory": []}
    memory = None
    for _ in range(rounds):
        wall_s, cpu_s, _ = timed_iteration(step)
        times["plain"].append((wall_s, cpu_s))
        times["counting"].append(_counting(engine, step, memory=False)[:2])
        *measured, memory = _counting(engine, step, memory=True)
        times["counting + memory"].append(tuple(measured))
    plain_wall, plain_cpu = (median([t[i] for t in times["plain"]]) for i in (0, 1))
    rows = [[kind, f"{median([t[0] for t in runs]):.3f}", f"{median([t[0] for t in runs]) / plain_wall:.3f}",
             f"{median([t[1] for t in runs]) / plain_cpu:.3f}"] for kind, runs in times.items()]
    print0(f"\n== The counting iteration with and without the memory measured ({rounds} rounds, medians) ==")
    print0(table(["iteration", "wall s", "wall / plain", "cpu / plain"], rows))
    counting = median([t[1] for t in times["counting"]])
    with_memory = median([t[1] for t in times["counting + memory"]])
    print0(f"memory measured / counting alone (cpu): {with_memory / counting:.3f}")

    terms = memory.allocator
    layers = sum(memory.layer_activation_bytes.values())
    position = PositionMemory(terms.base_bytes, terms.kept_bytes_per_micro_batch - layers,
                              terms.in_flight_micro_batches, terms.compute_transient_bytes,
                              terms.step_transient_bytes, memory.state_bytes, memory.fixed_buffer_bytes)
    peak = stage_peak(memory.state_bytes, layers, position)
    line = [engine.stage_id, bytes_to_string(memory.state_bytes), terms.in_flight_micro_batches,
            bytes_to_string(terms.kept_bytes_per_micro_batch), bytes_to_string(peak.predicted_peak_bytes),
            bytes_to_string(terms.measured_peak_bytes),
            f"{100 * (peak.predicted_peak_bytes / terms.measured_peak_bytes - 1):+.2f}%"]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, line)
    print0("\n== Memory per stage (the last counting iteration) ==")
    print0(table(["stage", "state", "in flight", "kept/micro-batch", "predicted peak", "measured peak", "error"],
                 every))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiniest GPT, one round")
    parser.add_argument("--reference", action="store_true",
                        help="profiler_overhead.py's reference GPT (layers outweigh the LM head) instead")
    options = parser.parse_args()
    shape, rounds = (TINY, 1) if options.quick else (REFERENCE if options.reference else LM_HEAD_GPT, 5)
    if launched():
        worker(shape, rounds)
    else:
        spawn(worker, PIPELINE, shape, rounds)


if __name__ == "__main__":
    main()
