"""Faults: a rank killed in the profiled iteration, a run killed while it saves, and bad input.

A killed rank ends the whole run, on both nodes, within FAILURE_BOUND_S, every rank exiting non-zero
with one line naming the rank that failed: its peers' connections break at once, naming the rank
takes liveness.GRACE_S (2.5 s), the launchers poll their ranks every second and rank 0 stays up to
3.5 s more for the others to read the store. Measured: about 6 s on a loaded 2-core machine. The
process-group timeout (DIST_TIMEOUT_S here), which bounds a hung rank, plays no part. Checkpoints are
published atomically: a save cut short leaves `latest` on the previous
complete checkpoint, which a resumed run loads and profiles. The runs that fail read their data with
upstream's default 2 DataLoader worker processes, alive when their rank dies.
"""
import json
import re
import subprocess
import sys

import psutil
import pytest

from tests.helpers.arguments import one_line_exit_2
from tests.helpers.flags import PP2, TINY_GPT, UPSTREAM_WORKERS, layout
from tests.helpers.launch import REPO, bare_env, explain, launch, read_losses
from tests.helpers.multinode import explain_nodes, run_nodes
from tests.helpers.tiny_gpt import check_totals

FAULT_SCRIPT = REPO / "tests" / "scripts" / "pretrain_with_fault.py"
FAILURE_BOUND_S = 20
DIST_TIMEOUT_S = 30


def fault_env(rank, iteration, at):
    return {"FAULT_RANK": str(rank), "FAULT_ITERATION": str(iteration), "FAULT_AT": at,
            "MEGATRON_DIST_TIMEOUT_S": str(DIST_TIMEOUT_S)}


def fault_time(output):
    return float(re.search(r"FAULT: killing rank \d+ .*, t=([\d.]+)", output).group(1))


def spawned_pids(launcher_output):
    return [int(pid) for pid in re.findall(r"process (\d+) spawned with command", launcher_output)]


def assert_all_gone(pids):
    for pid in pids:
        try:
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"rank process {pid} still running"
        except psutil.NoSuchProcess:
            pass


def error_lines(text, rank):
    """Rank `rank`'s one-line verdicts. Ranks share one pipe, so a line may lack its newline before
    another rank's: the text is cut at each "error: rank"."""
    said = re.findall(r"error: rank \d+ .*?(?=error: rank \d|\n|$)", text)
    return [line for line in said if line.startswith(f"error: rank {rank} ")]


# ---------------------------------------------------------------------------- a rank dies
@pytest.mark.launch
def test_rank_killed_in_the_profiled_iteration_ends_both_nodes(tmp_path):
    """pp 2 x dp 2 over two launchers; rank 3 (node 1) is SIGKILLed in its second backward pass of
    the profiled iteration 2. Ranks 0, 1 (node 0) see their connections break; the node-1 launcher
    terminates rank 2. Every rank says rank 3 failed, and both launchers end within FAILURE_BOUND_S."""
    flags = TINY_GPT + UPSTREAM_WORKERS + PP2 + ["--train-iters", "3", "--profile-flops-step", "2",
                                                 "--profile-flops-output", tmp_path / "profile"]
    nodes = run_nodes(FAULT_SCRIPT, flags, cwd=tmp_path, env=fault_env(3, 2, "backward"), timeout=240)
    details = explain_nodes(nodes)
    assert all(node.process.returncode != 0 for node in nodes), details
    rank_outputs = {rank: nodes[rank // 2].rank_output(rank) for rank in range(4)}
    killed_at = fault_time(rank_outputs[3])
    elapsed = max(node.ended_at for node in nodes) - killed_at
    assert elapsed < FAILURE_BOUND_S, details
    print(f"every rank ended {elapsed:.1f} s after rank 3 was killed")
    for rank in (0, 1, 2):
        lines = error_lines(rank_outputs[rank], rank)
        assert len(lines) == 1 and "rank 3 failed first" in lines[0], (rank, details)
    assert error_lines(rank_outputs[3], 3) == []
    assert all("exits successfully" not in node.output for node in nodes)
    assert_all_gone(spawned_pids(nodes[0].output) + spawned_pids(nodes[1].output))
    assert not (tmp_path / "profile" / "flops_profile_step2.json").exists()


@pytest.mark.launch
def test_killed_rank_0_is_named_though_the_store_died_with_it(tmp_path):
    """Rank 0 hosts the rendezvous store: when it is killed, the others name it from the store's silence."""
    flags = TINY_GPT + UPSTREAM_WORKERS + layout(pp=2) + ["--global-batch-size", "4", "--train-iters", "2",
                                                         "--profile-flops-step", "2"]
    process = launch(FAULT_SCRIPT, 2, flags, cwd=tmp_path, timeout=240, env=fault_env(0, 2, "backward"))
    output = process.stdout + process.stderr
    assert process.returncode != 0, explain(process)
    lines = error_lines(output, 1)
    assert len(lines) == 1 and "rank 0 failed first" in lines[0], explain(process)


@pytest.mark.launch
def test_an_error_on_one_rank_is_named_with_its_traceback_once(tmp_path):
    """A bug, not a kill: rank 1 raises in the profiled iteration. It prints its traceback and says it
    failed; rank 0, whose connection then breaks, names rank 1 and its error instead of a traceback."""
    flags = TINY_GPT + UPSTREAM_WORKERS + layout(pp=2) + ["--global-batch-size", "4", "--train-iters", "2",
                                                         "--profile-flops-step", "2"]
    process = launch(FAULT_SCRIPT, 2, flags, cwd=tmp_path, timeout=240, env=fault_env(1, 2, "raise"))
    output = process.stdout + process.stderr
    assert process.returncode == 1, explain(process)
    assert error_lines(output, 1) == ["error: rank 1 failed in iteration 2: RuntimeError: injected fault on rank 1"]
    lines = error_lines(output, 0)
    # Rank 0 stops by its own verdict ("stops in iteration 2: ...", or "stops: ..." from its heartbeat
    # thread) or, when the launcher's SIGTERM for
    # rank 1's exit comes first, by that ("stopped by SIGTERM: ..."); either way it names rank 1 and its error.
    assert len(lines) == 1, output
    assert lines[0].startswith(("error: rank 0 stops", "error: rank 0 stopped by SIGTERM: ")), output
    assert "rank 1 failed first (RuntimeError: injected fault on rank 1 in iteration 2)" in lines[0], output
    assert output.count("Traceback (most recent call last)") == 1


# ---------------------------------------------------------------------------- killed while saving
@pytest.mark.launch
def test_kill_while_saving_keeps_the_last_complete_checkpoint_and_the_resumed_run_profiles(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    common = TINY_GPT + PP2 + ["--train-iters", "4", "--save", checkpoints, "--save-interval", "2"]
    # Rank 1 (the last stage) dies right after writing its first file of the iteration-4 checkpoint;
    # rank 0 has all of its own files written by then.
    killed = launch(FAULT_SCRIPT, 2, common + UPSTREAM_WORKERS + ["--loss-record-file", tmp_path / "killed.jsonl"],
                    cwd=tmp_path, timeout=240, env=fault_env(1, 4, "save"))
    assert killed.returncode != 0, explain(killed)
    assert "FAULT: killing rank 1" in killed.stdout
    assert (checkpoints / "latest").read_text() == "global_step2"
    assert not (checkpoints / "global_step4").exists()
    complete = sorted(path.name for path in (checkpoints / "global_step2").iterdir())
    # layer files numbered as upstream's (its layer 0 is a function): 1 to 6
    assert complete == [f"layer_{index:02d}-model_00-model_states.pt" for index in range(1, 7)] + \
        ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    # What was written, never published: rank 1's files are missing (DeepSpeed alone would have
    # pointed `latest` at this, as soon as rank 0 had written its own files).
    partial = {path.name for path in (checkpoints / "global_step4.incomplete").iterdir()}
    assert partial < set(complete) and "mp_rank_01_model_states.pt" not in partial, partial

    resumed_losses_file = tmp_path / "resumed.jsonl"
    resumed = launch(REPO / "pretrain_gpt.py", 2,
                     common + ["--load", checkpoints, "--loss-record-file", resumed_losses_file,
                               "--profile-flops-step", "3", "--profile-flops-output", tmp_path / "profile"],
                     cwd=tmp_path, timeout=240)
    assert resumed.returncode == 0, explain(resumed)
    assert "loaded checkpoint" in resumed.stdout and "at iteration 2" in resumed.stdout
    killed_losses, resumed_losses = read_losses(tmp_path / "killed.jsonl"), read_losses(resumed_losses_file)
    assert sorted(resumed_losses) == [3, 4]
    assert resumed_losses == {it: killed_losses[it] for it in (3, 4)}  # bitwise: the same iterations again
    report = json.loads((tmp_path / "profile" / "flops_profile_step3.json").read_text())
    assert report["step"] == 3
    check_totals(report, layers=4, sequences=8, checkpointing=False)
    # The resumed run saved iteration 4 properly, replacing what the killed save left.
    assert (checkpoints / "latest").read_text() == "global_step4"
    assert sorted(path.name for path in (checkpoints / "global_step4").iterdir()) == complete
    assert not (checkpoints / "global_step4.incomplete").exists()


# ---------------------------------------------------------------------------- bad input
def bad_load_dir(tmp_path, tag="global_step2", create=True):
    load = tmp_path / "checkpoints"
    (load / tag).mkdir(parents=True) if create else load.mkdir()
    (load / "latest").write_text(tag)
    return load


@pytest.mark.launch
def test_profile_step_before_the_resumed_iteration_exits_2_before_any_collective(tmp_path):
    """End to end: pretrain_gpt.py alone, told it is one of 4 ranks, so reaching a collective would hang."""
    extra = ["--train-iters", "5", "--load", bad_load_dir(tmp_path), "--profile-flops-step", "2"]
    env = bare_env(WORLD_SIZE="4", RANK="0")
    process = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py")] + TINY_GPT + [str(a) for a in extra],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in process.stderr.splitlines() if line.startswith("error:")]
    assert process.returncode == 2, process.stderr[-2000:]
    assert lines == [f"error: --profile-flops-step 2 would never run: the checkpoint in --load {tmp_path}/checkpoints "
                     f"is at iteration 2, so training resumes at iteration 3"], process.stderr[-2000:]
    assert "Traceback" not in process.stderr + process.stdout


def _config(tmp_path, section):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(section))
    return ["--deepspeed", "--deepspeed_config", path]


def _partition_report(tmp_path, layer_types):
    """A profile report's JSON reduced to what planning a partition reads: each layer's measured seconds."""
    path = tmp_path / "flops_profile_step2.json"
    layers = [{"index": i, "type": name, "stage": 0, "fwd_latency_s": 0.001, "bwd_latency_s": 0.002,
               "recompute_latency_s": 0.0} for i, name in enumerate(layer_types)]
    path.write_text(json.dumps({"layers": layers, "totals": {"throughput_iter_s": 0.1},
                                "parallelism": {"micro_batches": 4}}))
    return ["--pp-partition-from-profile", path]


def _write(path, text):
    path.write_text(text)
    return path


TINY_GPT_LAYERS = ["EmbeddingPipe"] + ["ParallelTransformerLayerPipe"] * 4 + ["LayerNorm", "EmbeddingPipe"]

BAD_INPUT = {  # name: (flags after TINY_GPT --train-iters 5, given a tmp dir; words of the one line)
    "step_before_resume": (lambda tmp: ["--load", bad_load_dir(tmp), "--profile-flops-step", "1"],
                           "--profile-flops-step 1 would never run: the checkpoint in --load"),
    "latest_names_missing_checkpoint": (lambda tmp: ["--load", bad_load_dir(tmp, create=False)],
                                        "latest names checkpoint global_step2, which is not there"),
    "output_is_a_file": (lambda tmp: ["--profile-flops-step", "2", "--profile-flops-output", __file__],
                         "is not a writable directory"),
    "config_output_file_dir_missing": (
        lambda tmp: _config(tmp, {"flops_profiler": {"enabled": True, "output_file": str(tmp / "no" / "f.txt")}}),
        "flops_profiler.output_file"),
    "partition_method": (lambda tmp: ["--pp-partition-method", "balanced"],
                         "--pp-partition-method 'balanced': expected 'uniform', 'parameters' or 'type:REGEX'"),
    "partition_report_unreadable": (lambda tmp: ["--pp-partition-from-profile", tmp / "none.json"],
                                    "none.json cannot be read: No such file or directory"),
    "partition_report_of_another_model": (
        lambda tmp: _partition_report(tmp, TINY_GPT_LAYERS[:-2] + TINY_GPT_LAYERS[-1:]),
        "profiles another model: 6 layers against this PipelineModule's 7, the first difference at layer 5 "
        "(EmbeddingPipe there, LayerNorm here)"),
    "partition_report_and_method": (
        lambda tmp: _partition_report(tmp, TINY_GPT_LAYERS) + ["--pp-partition-method", "uniform"],
        "--pp-partition-from-profile and --pp-partition-method 'uniform' both choose the partition: give one"),
    "partition_report_without_pipeline": (
        lambda tmp: layout(pp=1) + ["--no-pipeline-parallel"] + _partition_report(tmp, TINY_GPT_LAYERS),
        "--pp-partition-from-profile cuts a pipeline's layers: --no-pipeline-parallel builds none"),
    "partition_report_not_the_profilers": (
        lambda tmp: ["--pp-partition-from-profile", _write(tmp / "list.json", "[1, 2]")],
        "list.json is not the profiler's JSON: a JSON list, not an object"),
    "partition_regex": (lambda tmp: ["--pp-partition-method", "type:transformer|("],
                        "is not a valid regular expression"),
    "partition_too_few_layers": (
        lambda tmp: ["--num-layers", "2"] + layout(pp=4) + ["--pp-partition-method", "type:transformer"],
        "--pipeline-model-parallel-size 4 exceeds the 2 layers --pp-partition-method type:transformer weighs"),
    "zero_stage_2_with_pipeline": (
        lambda tmp: layout(pp=2) + _config(tmp, {"zero_optimization": {"stage": 2}}),
        "ZeRO stage 2 cannot shard a pipeline's gradients"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUT))
def test_bad_input_exits_2_with_one_line(name, tmp_path, monkeypatch, capsys):
    """In this process, where no process group exists: any collective would raise, not exit 2."""
    flags, expected = BAD_INPUT[name]
    assert expected in one_line_exit_2(TINY_GPT + ["--train-iters", "5"] + flags(tmp_path), 4, monkeypatch, capsys)
