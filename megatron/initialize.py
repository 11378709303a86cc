"""Start-up: arguments, the distributed backend, the tensor/pipeline/data groups and the seeds."""
import os
import random
from dataclasses import asdict
from datetime import timedelta

import deepspeed
import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

import patches
from megatron import clean_exit, liveness, mpu
from megatron.arguments import ArgumentError, exit_on_bad_args, parse_args
from megatron.global_vars import set_args
from megatron.utils import print_rank_0


def initialize_megatron(extra_args_provider=None, args_defaults=None, argv=None):
    """Parse and check the flags (exit 2 on bad ones, before any collective), then start distributed."""
    args = parse_args(argv, extra_args_provider=extra_args_provider, defaults=args_defaults)
    try:
        check_machine_supports(args)
    except ArgumentError as error:
        exit_on_bad_args(str(error))
    set_args(args)
    patches.apply()
    _initialize_distributed(args)
    _set_random_seed(args.seed)
    for note in args.start_up_notes:
        print_rank_0(note)
    return args


def check_machine_supports(args):
    """What the flags ask of this machine: a communication backend and a precision its accelerator has.

    Kept out of parse_args so that a script's flags parse on any machine; still before any collective.
    """
    accelerator = get_accelerator()
    backend = args.distributed_backend
    if backend is not None and backend != accelerator.communication_backend_name():
        available = {"nccl": torch.distributed.is_nccl_available(), "gloo": torch.distributed.is_gloo_available()}
        if not available.get(backend, False) or (backend == "nccl" and accelerator.device_name() != "cuda"):
            raise ArgumentError(f"--distributed-backend {backend} is not available on this machine (accelerator "
                                f"{accelerator.device_name()}): use --distributed-backend "
                                f"{accelerator.communication_backend_name()}")
    if args.fp16 and not accelerator.is_fp16_supported():
        raise ArgumentError(f"--fp16: DeepSpeed's {accelerator.device_name()} accelerator on this machine has no "
                            f"float16 support: use --bf16 (or neither, for fp32)")
    if args.bf16 and not accelerator.is_bf16_supported():
        raise ArgumentError(f"--bf16: DeepSpeed's {accelerator.device_name()} accelerator on this machine has no "
                            f"bfloat16 support")


def _initialize_distributed(args):
    accelerator = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank or 0))
    args.local_rank = local_rank
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank)
    backend = args.distributed_backend or accelerator.communication_backend_name()
    # A bounded timeout: a rank that dies must not leave the others waiting for half an hour. A dead
    # peer is usually noticed at once (its connections close); this bounds the rest (a hung peer, a
    # node cut off the network).
    if args.distributed_timeout_minutes is not None:
        timeout = timedelta(minutes=args.distributed_timeout_minutes)
    else:
        timeout = timedelta(seconds=int(os.environ.get("MEGATRON_DIST_TIMEOUT_S", "600")))
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout, verbose=False)
    # A run that succeeded must not abort at exit in gloo's threads (see clean_exit). Registered
    # before the heartbeat, so it runs after the heartbeat has stopped.
    clean_exit.at_exit()
    args.rank = torch.distributed.get_rank()
    args.world_size = torch.distributed.get_world_size()
    liveness.start(args.rank, args.world_size)
    mpu.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    # DeepSpeed's activation checkpointing saves and restores the tensor-parallel RNG states on
    # recompute; it needs to know the tensor-parallel layout for that.
    # Its options: the DeepSpeed config's activation_checkpointing section and the flags (megatron/arguments.py).
    chunks = -(-args.num_layers // args.checkpoint_num_layers)
    deepspeed.checkpointing.configure(mpu, num_checkpoints=chunks, **asdict(args.activation_checkpointing))
    _unlink_shm_buffer()


def _unlink_shm_buffer():
    """DeepSpeed 0.19.8's CPU comm op creates a 66 MiB /dev/shm buffer per rank and never removes it.

    init_distributed returns once this rank has mapped every peer's buffer; after a barrier every rank
    has, so the name can go: the mappings stay valid, and the memory is freed when the run ends.
    """
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
            f"{os.environ.get('MASTER_PORT')}_{torch.distributed.get_rank()}")
    torch.distributed.barrier()  # every rank, whether or not it has a buffer: no rank left waiting
    if os.path.exists(name):
        os.unlink(name)


def _set_random_seed(seed):
    """Same seed on tensor-parallel ranks of a stage, distinct per stage (as Megatron does)."""
    stage_seed = seed + 100 * mpu.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    mpu.model_parallel_cuda_manual_seed(stage_seed)
