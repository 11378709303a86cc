"""pretrain_gpt.py with a fault injected into one rank at a chosen point, for the fault tests.

    FAULT_RANK=3 FAULT_ITERATION=2 FAULT_AT=backward  python pretrain_with_fault.py <pretrain_gpt.py flags>

FAULT_AT=backward: the rank dies in the second BackwardPass of iteration FAULT_ITERATION.
FAULT_AT=save: the rank dies right after writing its first file of the iteration's checkpoint.
FAULT_AT=raise: the rank raises RuntimeError in that second BackwardPass instead (a bug, not a kill).
FAULT_AT=entry: the rank raises RuntimeError while building its profile entry (in get_report).
FAULT_AT=slow: the rank sleeps SLOW_S (default 0.25) in every ForwardPass of iteration FAULT_ITERATION.
FAULT_AT=memory: the rank's memory measurement raises RuntimeError as it reads the allocator around its second
ForwardPass (in whichever iteration measures memory): the profiler's own failure, inside the iteration.
FAULT_AT=none: no fault (for ODD_TENSORS alone).
ODD_TENSORS=1 (any FAULT_AT): every rank keeps alive, from before training, tensors whose storage cannot be read:
the fake tensors a torch.compile'd function leaves once it has run (it runs again in every ForwardPass), a meta
tensor, a sparse one and a wrapper subclass without storage.
Nothing is mocked: the process is gone, as after an OOM kill or a node failure.
"""
import os
import runpy
import signal
import sys
import time
from pathlib import Path

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from tests.helpers.odd_tensors import compiled_with_fake_tensors, odd_tensors

FAULT_RANK = int(os.environ["FAULT_RANK"])
FAULT_ITERATION = int(os.environ["FAULT_ITERATION"])
FAULT_AT = os.environ["FAULT_AT"]
RANK = int(os.environ["RANK"])


def die():
    print(f"FAULT: killing rank {RANK} (pid {os.getpid()}) in iteration {FAULT_ITERATION} at {FAULT_AT}, "
          f"t={time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def raise_error():
    raise RuntimeError(f"injected fault on rank {RANK}")


def fail_in_backward(fault):
    original = PipelineEngine._INSTRUCTION_MAP[schedule.BackwardPass]
    seen = {"count": 0}

    def backward(engine, *args, **kwargs):
        if engine.global_steps + 1 == FAULT_ITERATION:  # global_steps counts finished iterations
            seen["count"] += 1
            if seen["count"] == 2:
                fault()
        return original(engine, *args, **kwargs)

    PipelineEngine._INSTRUCTION_MAP[schedule.BackwardPass] = backward


def slow_forward():
    original = PipelineEngine._INSTRUCTION_MAP[schedule.ForwardPass]
    delay = float(os.environ.get("SLOW_S", "0.25"))

    def forward(engine, *args, **kwargs):
        if engine.global_steps + 1 == FAULT_ITERATION:
            time.sleep(delay)
        return original(engine, *args, **kwargs)

    PipelineEngine._INSTRUCTION_MAP[schedule.ForwardPass] = forward


def fail_in_entry():
    from patches.profiler.module_profiler import ModuleProfiler

    def tree(self):
        raise RuntimeError(f"injected fault on rank {RANK}")

    ModuleProfiler.tree = tree


def kill_in_save():
    original = TorchCheckpointEngine.save

    def save(self, state_dict, path):
        result = original(self, state_dict, path)
        if f"global_step{FAULT_ITERATION}" in str(path):
            die()
        return result

    TorchCheckpointEngine.save = save


def fail_in_memory():
    from patches.profiler.allocator_trace import CpuAllocatorRecorder

    original = CpuAllocatorRecorder.instruction
    seen = {"count": 0}

    def instruction(self, name, buffer_id):
        if name == "ForwardPass":
            seen["count"] += 1
            if seen["count"] == 2:
                raise_error()
        return original(self, name, buffer_id)

    CpuAllocatorRecorder.instruction = instruction


def keep_odd_tensors_alive():
    doubled = compiled_with_fake_tensors()
    original = PipelineEngine._INSTRUCTION_MAP[schedule.ForwardPass]

    def forward(engine, *args, **kwargs):
        doubled(torch.randn(4))
        return original(engine, *args, **kwargs)

    PipelineEngine._INSTRUCTION_MAP[schedule.ForwardPass] = forward
    return [doubled, *odd_tensors().values()]


ODD_TENSORS = keep_odd_tensors_alive() if os.environ.get("ODD_TENSORS") == "1" else []
if RANK == FAULT_RANK:
    {"backward": lambda: fail_in_backward(die), "raise": lambda: fail_in_backward(raise_error),
     "save": kill_in_save, "entry": fail_in_entry, "slow": slow_forward, "memory": fail_in_memory,
     "none": lambda: None}[FAULT_AT]()

script = Path(__file__).resolve().parents[2] / "pretrain_gpt.py"
sys.argv = [str(script)] + sys.argv[1:]
runpy.run_path(str(script), run_name="__main__")
