"""Run a training script with the patch set applied: one change to the launch line, nothing in the checkout.

    deepspeed --num_gpus 4 --module patches.launch pretrain_gpt.py <flags> --profile-flops-step 2
    torchrun --nproc_per_node 4 -m patches.launch pretrain_gpt.py <flags> --profile-flops-step 2
    python -m patches.launch pretrain_gpt.py <flags>

DeepSpeed's launcher with --module runs `python -u -m patches.launch --local_rank=N pretrain_gpt.py ...`; the
script then sees `pretrain_gpt.py --local_rank=N ...`, as under a plain launch. The script runs as `__main__`
with its own directory first on sys.path (its `megatron` is the user's), after the DeepSpeed patches
(patches.apply) and the Megatron-DeepSpeed patches (patches.to_megatron.megatron_upstream) are in place; those register
patches.process.clean_exit's teardown, so that a run that finished ends its process groups before the interpreter
finalizes (upstream's `pretrain` never does) instead of aborting at exit.
"""
import os
import runpy
import sys
from typing import List, Tuple

from patches.process.errors import PatchConfigError, exit_with_one_line

USAGE = "usage: python -m patches.launch [--local_rank=N] SCRIPT.py [script arguments ...]"


def split_launcher_arguments(argv: List[str]) -> Tuple[List[str], str, List[str]]:
    """(the launcher's --local_rank arguments, the script, the script's own arguments) of argv[1:]."""
    launcher: List[str] = []
    rest = list(argv)
    while rest and rest[0].startswith("--local_rank"):
        launcher.append(rest.pop(0))
        if launcher[-1] == "--local_rank" and rest:  # the spaced form, --local_rank N
            launcher.append(rest.pop(0))
    if not rest or rest[0].startswith("-"):
        raise ValueError(USAGE)
    return launcher, rest[0], rest[1:]


def main(argv: List[str]) -> None:
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE + "\n\n" + __doc__.strip())
        return
    try:
        launcher, script, script_args = split_launcher_arguments(argv)
    except ValueError as error:
        exit_with_one_line(str(error))
    if not os.path.isfile(script):
        exit_with_one_line(f"patches.launch: no script {script} (from {os.getcwd()})")

    import patches

    patches.apply_to_this_run(script_args)

    sys.argv = [script] + launcher + script_args
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` would have it
    try:
        runpy.run_path(script, run_name="__main__")
    except PatchConfigError as error:  # e.g. a flops_profiler key the profiler cannot honour: raised by the engine
        exit_with_one_line(str(error))


if __name__ == "__main__":
    main(sys.argv[1:])
