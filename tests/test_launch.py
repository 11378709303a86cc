"""patches.launch and the Megatron-DeepSpeed patches, on small Megatron-shaped packages written by the tests.

The real upstream tree is exercised by tests/test_upstream_checkout.py (when MEGATRON_DEEPSPEED_DIR is set);
these check what needs no tree: the launcher's argument order, the import hook, and the one-line answers
for a Megatron that lacks what the patches need.
"""
import subprocess
import sys
import textwrap

import pytest

from patches.launch import USAGE, split_launcher_arguments
from tests.helpers.launch import REPO, bare_env


def test_the_deepspeed_launchers_local_rank_goes_after_the_script():
    launcher, script, rest = split_launcher_arguments(["--local_rank=3", "pretrain_gpt.py", "--num-layers", "2"])
    assert (launcher, script, rest) == (["--local_rank=3"], "pretrain_gpt.py", ["--num-layers", "2"])
    assert split_launcher_arguments(["--local_rank", "1", "x.py"]) == (["--local_rank", "1"], "x.py", [])
    assert split_launcher_arguments(["x.py", "--local_rank=0"]) == ([], "x.py", ["--local_rank=0"])


@pytest.mark.parametrize("argv", [[], ["--local_rank=0"], ["--num-layers", "2"]])
def test_no_script_is_a_usage_error(argv):
    with pytest.raises(ValueError, match="usage: python -m patches.launch"):
        split_launcher_arguments(argv)


def _write(root, files):
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def _run_launch(cwd, *args):
    env = bare_env(RANK="0")
    return subprocess.run([sys.executable, "-m", "patches.launch", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


# A Megatron of upstream's shape: parse_args(extra_args_provider, ignore_unknown_args) and
# train_step(forward_step_func, data_iterator, model, optimizer, ...), which initialize imports by name.
UPSTREAM_SHAPED = {
    "megatron/__init__.py": "",
    "megatron/global_vars.py": """
        _ARGS = None
        def get_args():
            return _ARGS
    """,
    "megatron/arguments.py": """
        import argparse
        def parse_args(extra_args_provider=None, ignore_unknown_args=False):
            parser = argparse.ArgumentParser(allow_abbrev=False)
            parser.add_argument("--train-iters", type=int, default=10)
            parser.add_argument("--deepspeed", action="store_true")
            parser.add_argument("--local_rank", type=int, default=None)
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return parser.parse_args()
    """,
    "megatron/initialize.py": """
        from megatron.arguments import parse_args
        from megatron import global_vars
        def initialize():
            global_vars._ARGS = parse_args(None, False)
            return global_vars._ARGS
    """,
    "megatron/training.py": """
        from megatron.global_vars import get_args
        def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
            return "unprofiled step"
    """,
    "pretrain_gpt.py": """
        import sys
        from megatron.initialize import initialize
        from megatron import training
        args = initialize()
        print("argv", sys.argv[1:])
        print("flags", args.profile_flops_step, args.profile_flops_output)
        args.curr_iteration = 0
        print("step 1:", training.train_step(None, None, [None], None, None, None))
        from megatron import arguments
        print(hasattr(arguments.parse_args, "__wrapped__"), hasattr(training.train_step, "__wrapped__"))
    """,
}


@pytest.mark.launch  # starts a Python process
def test_upstream_shaped_megatron_gets_the_profiler_flags_and_keeps_its_own_script_order(tmp_path):
    _write(tmp_path, UPSTREAM_SHAPED)
    process = _run_launch(tmp_path, "--local_rank=0", "pretrain_gpt.py", "--train-iters", "3",
                          "--profile-flops-step", "3", "--deepspeed", "--profile-flops-output", tmp_path / "out")
    assert process.returncode == 0, process.stderr
    lines = process.stdout.splitlines()
    assert "argv ['--local_rank=0', '--train-iters', '3', '--profile-flops-step', '3', '--deepspeed', " \
           f"'--profile-flops-output', '{tmp_path / 'out'}']" in lines
    assert f"flags 3 {tmp_path / 'out'}" in lines
    # iteration 1 is neither the profiled one nor the one counting its FLOPs: their own train_step ran
    assert "step 1: unprofiled step" in lines
    assert "True True" in lines  # both patched
    # the start-up line comes with the first iteration of a DeepSpeed engine (tests/test_upstream_checkout.py):
    # this train_step trained none
    assert "> FLOPs profiler (patches)" not in process.stdout


@pytest.mark.parametrize("flags, message", [
    (["--profile-flops-step", "5"], "error: --profile-flops-step 5 is beyond --train-iters 3"),
    (["--profile-flops-step", "0"], "error: --profile-flops-step 0 must be >= 1"),
])
@pytest.mark.launch  # starts a Python process
def test_a_profile_step_that_cannot_run_is_one_line_and_exit_2(tmp_path, flags, message):
    _write(tmp_path, UPSTREAM_SHAPED)
    process = _run_launch(tmp_path, "pretrain_gpt.py", "--train-iters", "3", "--deepspeed", *flags)
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == [message]


@pytest.mark.launch  # starts a Python process
def test_a_megatron_without_train_step_is_named_and_profiling_refused(tmp_path):
    files = dict(UPSTREAM_SHAPED)
    files["megatron/training.py"] = "def other_step(model):\n    return None\n"
    files["pretrain_gpt.py"] = "from megatron.initialize import initialize\nimport megatron.training\ninitialize()\n"
    _write(tmp_path, files)
    refused = _run_launch(tmp_path, "pretrain_gpt.py", "--deepspeed", "--profile-flops-step", "1")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "error: patches.launch: this Megatron has no megatron.training.train_step(forward_step_func, "
        f"data_iterator, model, optimizer, ...) ({tmp_path / 'megatron' / 'training.py'}): --profile-flops-step "
        "is not available; remove it (the DeepSpeed config's flops_profiler section still profiles pipeline runs)"]
    unprofiled = _run_launch(tmp_path, "pretrain_gpt.py", "--deepspeed")
    assert unprofiled.returncode == 0
    assert unprofiled.stderr.strip().splitlines()[0].startswith("warning: patches.launch: this Megatron has no ")


@pytest.mark.launch  # starts a Python process
def test_a_script_that_is_not_there_and_a_missing_script_are_one_line(tmp_path):
    missing = _run_launch(tmp_path, "--local_rank=0", "nope.py")
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"error: patches.launch: no script nope.py (from {tmp_path})"
    usage = _run_launch(tmp_path, "--local_rank=0")
    assert (usage.returncode, usage.stderr.strip()) == (2, f"error: {USAGE}")


@pytest.mark.launch  # starts a Python process
def test_the_script_runs_as_main_with_its_own_directory_first_on_the_path(tmp_path):
    _write(tmp_path, {"elsewhere/script.py": """
        import sys, os
        print(__name__, sys.argv, os.path.basename(sys.path[0]))
    """})
    process = _run_launch(tmp_path, "elsewhere/script.py", "a", "--b")
    assert process.returncode == 0, process.stderr
    assert process.stdout.strip().splitlines()[-1] == "__main__ ['elsewhere/script.py', 'a', '--b'] elsewhere"


@pytest.mark.launch  # starts a Python process
def test_a_megatron_that_profiles_itself_is_left_alone(tmp_path):
    files = dict(UPSTREAM_SHAPED)
    files["megatron/__init__.py"] = "PROFILES_WITH_PATCHES = True\n"
    files["pretrain_gpt.py"] = """
        from megatron.initialize import initialize
        from megatron import training, arguments
        print(hasattr(arguments.parse_args, "__wrapped__"), hasattr(training.train_step, "__wrapped__"))
    """
    _write(tmp_path, files)
    process = _run_launch(tmp_path, "pretrain_gpt.py")
    assert process.returncode == 0, process.stderr
    assert process.stdout.strip().splitlines()[-1] == "False False"


@pytest.mark.launch  # starts a Python process
def test_the_one_line_edit_works_after_the_scripts_own_imports(tmp_path):
    """`import patches; patches.apply_to_this_run()` placed after `from megatron... import` still reaches the
    names the script's modules bound (megatron.initialize's parse_args)."""
    files = dict(UPSTREAM_SHAPED)
    files["pretrain_gpt.py"] = """
        from megatron.initialize import initialize
        from megatron import training
        import patches
        patches.apply_to_this_run()
        patches.apply_to_this_run()  # twice (a launch with the module and the edit): patched once
        args = initialize()
        print("flags", args.profile_flops_step)
        from megatron import arguments
        print(hasattr(arguments.parse_args, "__wrapped__"), hasattr(training.train_step, "__wrapped__"))
    """
    _write(tmp_path, files)
    env = bare_env(RANK="0")
    process = subprocess.run([sys.executable, "pretrain_gpt.py", "--deepspeed", "--profile-flops-step", "2"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr
    assert process.stdout.strip().splitlines()[-2:] == ["flags 2", "True True"]


@pytest.mark.launch
def test_a_section_key_the_patched_engine_refuses_is_one_line_and_exit_2(tmp_path):
    """DeepSpeedEngine.__init__ raises PatchConfigError (a ValueError: a library raises); the launch module,
    the command line, turns it into one line and exit 2."""
    from tests.helpers.launch import free_port

    config = tmp_path / "ds.json"
    config.write_text('{"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, '
                      '"flops_profiler": {"enabled": true, "recompute_fwd_factor": 1.0}}')
    env = bare_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    script = REPO / "tests" / "scripts" / "plain_engine.py"
    process = subprocess.run([sys.executable, "-m", "patches.launch", str(script), str(config)], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=120)
    assert process.returncode == 2, process.stderr[-2000:]
    errors = [line for line in process.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: flops_profiler.recompute_fwd_factor 1 is not used: recompute FLOPs are measured "
                      "(recompute_flops in the report); remove the key or set it to 0"], process.stderr[-2000:]
    assert "Traceback" not in process.stderr


def test_upstream_runs_whose_shapes_change_are_known_before_they_start(tmp_path):
    """Curriculum learning (the DeepSpeed config's section, read from the file before upstream reads it itself),
    data-efficiency curriculum and random-LTD change the shapes between iterations: the schedule counts in the
    profiled iteration; the report's sequence length is the one the iteration ran."""
    from argparse import Namespace

    from patches.to_megatron.upstream_run import iteration_seq_length, shapes_change

    config = tmp_path / "ds.json"
    config.write_text('{"curriculum_learning": {"enabled": true, "curriculum_type": "seqlen"}}')
    assert shapes_change(Namespace(deepspeed_config=str(config))) == \
        "curriculum learning (the DeepSpeed config's curriculum_learning section)"
    assert shapes_change(Namespace(curriculum_learning_legacy=True, random_ltd=True)) == \
        "curriculum learning (the DeepSpeed config's curriculum_learning section), random-LTD"
    assert shapes_change(Namespace(data_efficiency_curriculum_learning=True)) == "data-efficiency curriculum learning"
    assert shapes_change(Namespace(deepspeed_config=None)) is None
    assert iteration_seq_length(Namespace(seq_length=64, curriculum_learning_legacy=True, curriculum_seqlen=40)) == 40
    assert iteration_seq_length(Namespace(seq_length=64, curriculum_learning_legacy=False, curriculum_seqlen=40)) == 64
