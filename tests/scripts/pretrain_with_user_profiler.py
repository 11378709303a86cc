"""pretrain_gpt.py with the user's own profiling code written into its train loop, as the user's report has it:

    prof = FlopsProfiler(model[0])     # every rank, before the profiled iteration
    prof.start_profile()
    train_step(...)
    if dp rank 0 and the last pipeline stage and tp rank 0:
        prof.print_model_profile(profile_step=N)
        prof.end_profile()

    USER_PROFILE_STEP=N USER_PROFILE_JSON=path  python pretrain_with_user_profiler.py <pretrain_gpt.py flags>

The printing rank also writes the report's JSON to USER_PROFILE_JSON. Nothing of the profiler is mocked.
"""
import os
import runpy
import sys
from pathlib import Path

from deepspeed.profiling.flops_profiler import FlopsProfiler

import megatron.training as training
from megatron import mpu
from megatron.global_vars import get_args

PROFILE_STEP = int(os.environ["USER_PROFILE_STEP"])
JSON_PATH = os.environ["USER_PROFILE_JSON"]
original_train_step = training.train_step


def train_step_with_user_profiler(forward_step_func, data_iterator, model, optimizer, lr_scheduler):
    iteration = get_args().curr_iteration
    prof = None
    if iteration == PROFILE_STEP:
        prof = FlopsProfiler(model[0])
        prof.start_profile()
    result = original_train_step(forward_step_func, data_iterator, model, optimizer, lr_scheduler)
    if prof is not None and mpu.get_data_parallel_rank() == 0 and mpu.is_pipeline_last_stage() \
            and mpu.get_tensor_model_parallel_rank() == 0:
        prof.print_model_profile(profile_step=PROFILE_STEP)
        prof.write_json(JSON_PATH)
        prof.end_profile()
    return result


training.train_step = train_step_with_user_profiler
script = Path(__file__).resolve().parents[2] / "pretrain_gpt.py"
sys.argv[0] = str(script)
runpy.run_path(str(script), run_name="__main__")
