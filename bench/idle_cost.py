"""What the patches cost when nothing is profiled: a train_batch with `patches.apply()` in force against
stock DeepSpeed's, on the same PipelineEngine, interleaved iteration by iteration.

    python bench/idle_cost.py            # spawns 2 ranks (pipeline 2) on CPU
    python bench/idle_cost.py --quick    # a few iterations: a smoke run

The patches replace class attributes (DeepSpeedEngine, PipelineEngine, FlopsProfiler) and one module
name (deepspeed.runtime.engine.log_dist). Both sets are recorded, stock before `patches.apply()` and
patched after it, and swapped in before each iteration: stock, patched, patched, stock, ... on the same
engine, so a machine shared with other work slows both alike and neither always runs first. The engine is a user's plain
PipelineModule (Linear 512 x 512 + ReLU, 8 layers), micro-batch 16, 8 micro-batches, fp32, the
flops_profiler config section off. The last line is `patched idle / stock train_batch time ratio: X.XXX`
(medians of the slowest rank's wall time between barriers).
"""
import argparse

import torch
import torch.distributed as dist

# A script: its own directory is on sys.path, so the sibling harness imports by name.
from harness import launched, machine, median, print0, quiet_logs, spawn, timed, unlink_shm_buffer

WIDTH, LAYERS, MICRO_BATCH, MICRO_BATCHES = 512, 8, 16, 8


def patched_attributes():
    """{owner: {name: value}} of every attribute patches.apply() replaces, read before and after it."""
    import deepspeed.runtime.engine as ds_engine
    from deepspeed.profiling.flops_profiler.profiler import FlopsProfiler
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    owners = (DeepSpeedEngine, PipelineEngine, FlopsProfiler)
    stock = {owner: dict(vars(owner)) for owner in owners}
    stock_log_dist = ds_engine.log_dist
    import patches
    patches.apply()
    changed = {owner: {name: value for name, value in vars(owner).items() if stock[owner].get(name) is not value}
               for owner in owners}
    before = {owner: {name: stock[owner].get(name) for name in names} for owner, names in changed.items()}
    before[ds_engine] = {"log_dist": stock_log_dist}
    changed[ds_engine] = {"log_dist": ds_engine.log_dist}
    return before, changed


def use(attributes):
    for owner, values in attributes.items():
        for name, value in values.items():
            if value is None:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)


def worker(iterations):
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    quiet_logs()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    unlink_shm_buffer()
    stock, patched = patched_attributes()
    torch.manual_seed(0)
    layers = [spec for _ in range(LAYERS) for spec in (LayerSpec(torch.nn.Linear, WIDTH, WIDTH),
                                                       LayerSpec(torch.nn.ReLU))]
    module = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    config = {"train_batch_size": MICRO_BATCH * MICRO_BATCHES, "train_micro_batch_size_per_gpu": MICRO_BATCH,
              "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=1e-4),
                                           config=config)
    generator = torch.Generator().manual_seed(1)

    def batches():
        while True:
            x = torch.randn(MICRO_BATCH, WIDTH, generator=generator)
            yield x, x.flip(-1)

    data = batches()
    for _ in range(3):  # warm-up
        engine.train_batch(data_iter=data)
    times = {"stock": [], "patched": []}
    for i in range(2 * iterations):
        name = ("stock", "patched", "patched", "stock")[i % 4]  # ABBA: neither always runs first
        use(stock if name == "stock" else patched)
        seconds, _ = timed(lambda: engine.train_batch(data_iter=data))
        times[name].append(seconds)
    use(patched)
    ratio = median(times["patched"]) / median(times["stock"])
    print0(f"machine: {machine()}")
    stock_ms, patched_ms = median(times["stock"]) * 1e3, median(times["patched"]) * 1e3
    print0(f"train_batch, {iterations} iterations each, interleaved: stock median {stock_ms:.2f} ms, "
           f"patched (nothing profiled) median {patched_ms:.2f} ms")
    print0(f"patched idle / stock train_batch time ratio: {ratio:.3f}")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few iterations: a smoke run")
    parser.add_argument("--iterations", type=int, default=60, help="iterations of each, interleaved")
    args = parser.parse_args()
    iterations = 3 if args.quick else args.iterations
    if launched():
        worker(iterations)
    else:
        spawn(worker, 2, iterations)


if __name__ == "__main__":
    main()
