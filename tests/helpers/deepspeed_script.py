"""The start of a plain DeepSpeed script run by the deepspeed launcher (tests/scripts/): its config, the
patches applied, gloo, a fixed seed."""
import json
import sys

import deepspeed
import torch

import patches
from patches.process import clean_exit


def start_patched_gloo_run(seed=0):
    """Read the DeepSpeed config named last on the command line (the launcher puts --local_rank=N first),
    apply the patches, join the gloo process group and seed torch; returns the config."""
    with open(sys.argv[-1]) as f:
        config = json.load(f)
    patches.apply()
    deepspeed.init_distributed(dist_backend="gloo")
    clean_exit.at_exit()
    torch.manual_seed(seed)
    return config
