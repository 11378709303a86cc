"""What the benchmarks share: starting ranks on CPU, building the GPT, timing iterations, tables.

A benchmark runs as `python bench/X.py` (it spawns its ranks over gloo) or under a launcher that
already started them (`deepspeed --num_gpus N bench/X.py`, torchrun). Every rank runs one thread, so
two ranks fill this project's 2-core machine without fighting over cores.
"""
import os
import platform
import socket
import statistics
import sys
import time

# A script of this checkout: our `megatron` is imported from the checkout root (the parent of bench/), since the
# project installs only `patches` (an installed `megatron` would clash with the user's Megatron-DeepSpeed).
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The reference config of the overhead benchmark (hidden 256, 4 layers, sequence 256, micro-batch 4,
# 8 micro-batches, pipeline 2) and the tiniest GPT that still has every kind of layer.
REFERENCE = {"hidden": 256, "heads": 4, "layers": 4, "seq": 256, "micro_batch": 4, "micro_batches": 8,
             "vocab": 1024}
TINY = {"hidden": 32, "heads": 4, "layers": 2, "seq": 16, "micro_batch": 2, "micro_batches": 2, "vocab": 192}


# ---------------------------------------------------------------- starting ranks
def launched():
    """True when a launcher (deepspeed, torchrun) started this process as one rank of a group."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, nprocs, *args):
    """worker(*args) on nprocs fresh ranks (torch.multiprocessing spawn, gloo on 127.0.0.1)."""
    mp.spawn(_spawned_rank, args=(nprocs, free_port(), worker, args), nprocs=nprocs, join=True)


def _spawned_rank(rank, nprocs, port, worker, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    worker(*args)


def quiet_logs():
    """DeepSpeed's info logs, and torch's warning that c10d::broadcast_ has no autograd kernel (DeepSpeed's
    pipeline sends activations with broadcasts), repeated on every rank, would bury the tables."""
    import logging
    import warnings

    from deepspeed.utils import logger
    logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r"c10d::broadcast_: an autograd kernel was not registered")


def unlink_shm_buffer():
    """Remove the name of this rank's /dev/shm all-reduce buffer once every rank has mapped them all.

    DeepSpeed's CPU communication op (deepspeed/ops/csrc/cpu/comm/shm.cpp, 0.19.8) creates a 66 MiB
    buffer per rank, deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>, and never unlinks it:
    every run would leave them in memory until reboot. The mappings stay valid after the unlink."""
    dist.barrier()  # every rank has opened every buffer in init_distributed
    name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_" \
           f"{os.environ['MASTER_PORT']}_{dist.get_rank()}"
    if os.path.exists(name):
        os.unlink(name)


# ---------------------------------------------------------------- the GPT
def megatron_flags(shape, pipeline, train_iters=1000):
    """pretrain_gpt.py's flags for `shape` on synthetic data: fp32, no dropout (so scaled-dot-product
    attention runs its fused CPU kernel, as flash attention does on a GPU)."""
    return [
        "--num-layers", shape["layers"], "--hidden-size", shape["hidden"], "--num-attention-heads", shape["heads"],
        "--seq-length", shape["seq"], "--max-position-embeddings", shape["seq"],
        "--micro-batch-size", shape["micro_batch"],
        "--global-batch-size", shape["micro_batch"] * shape["micro_batches"],
        "--pipeline-model-parallel-size", pipeline, "--synthetic-vocab-size", shape["vocab"],
        "--make-vocab-size-divisible-by", 8, "--hidden-dropout", 0, "--attention-dropout", 0,
        "--lr", 1e-4, "--train-iters", train_iters, "--eval-iters", 0, "--seed", 1234,
    ]


def init_megatron(shape, pipeline):
    """initialize_megatron (distributed, model-parallel groups, seeds) for `shape`; returns args.

    The world must hold exactly `pipeline` ranks (one data-parallel replica)."""
    from megatron.data_iterators import synthetic_datasets
    from megatron.initialize import initialize_megatron

    world = int(os.environ["WORLD_SIZE"])
    if world != pipeline:
        raise SystemExit(f"error: this benchmark needs {pipeline} ranks (pipeline {pipeline}), got {world}")
    torch.set_num_threads(1)
    quiet_logs()
    flags = [str(flag) for flag in megatron_flags(shape, pipeline)]
    args = initialize_megatron(argv=flags, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    unlink_shm_buffer()
    # The synthetic dataset provider also sets the padded vocabulary the model is built with.
    args.train_dataset, _, _ = synthetic_datasets(args, [10**6, 0, 0])
    return args


def build_pipeline_engine(args):
    """The PipelineEngine pretrain_gpt.py trains, and a step() running one train_batch on it."""
    from megatron.data_iterators import pipeline_batches
    from megatron.model import GPTModelPipe
    from megatron.training import setup_model_and_optimizer

    engine = setup_model_and_optimizer(lambda: GPTModelPipe(args))[0][0]
    data = pipeline_batches(args.train_dataset, 0, args.micro_batch_size, 1, 0)
    needs_data = engine.is_first_stage() or engine.is_last_stage()

    def step():
        engine.train_batch(data_iter=data if needs_data else None)
    return engine, step


def set_pipeline_checkpointing(engine, on):
    """Activation checkpointing on or off on a built pipeline (the same weights either way)."""
    engine.module.set_checkpoint_interval(1 if on else 0)


# ---------------------------------------------------------------- timing
def timed(fn):
    """(seconds, fn()) between two barriers: the time of the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    dist.barrier()
    return time.perf_counter() - start, result


def timed_iteration(fn):
    """(wall s of the slowest rank, CPU s summed over ranks, fn()). CPU time counts the work done,
    whatever else runs on the machine: the steadier measure on a shared machine."""
    cpu_start = time.process_time()
    wall_s, result = timed(fn)
    cpu = torch.tensor([time.process_time() - cpu_start], dtype=torch.float64)
    dist.all_reduce(cpu)
    return wall_s, float(cpu.item()), result


def median(values):
    return statistics.median(values) if values else float("nan")


def sum_over_ranks(value):
    """An exact int summed over the world (the stages of one replica)."""
    tensor = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(tensor)
    return int(tensor.item())


def print0(*parts):
    if dist.get_rank() == 0:
        print(*parts, flush=True)


# ---------------------------------------------------------------- printing
def table(headers, rows, left=1):
    """Fixed-width text table: the first `left` columns left-aligned, the others right-aligned."""
    cells = [list(map(str, headers))] + [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row):
        return "  ".join(cell.ljust(w) if i < left else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def machine():
    """One line naming the machine, for the tables' captions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = f"{names[0]} x {len(names)} logical cores" if names else cpu
    except OSError:
        pass
    import deepspeed
    return (f"{cpu}; torch {torch.__version__}, deepspeed {deepspeed.__version__}, Python "
            f"{platform.python_version()}; gloo, 1 thread per rank; {load()}")


def load():
    """The machine's load averages: how much else was running while this benchmark measured."""
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} cores"
