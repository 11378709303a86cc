"""Flags that cannot work together stop the run at start: one line naming the problem, exit code 2.

Checked in this process through parse_args (what pretrain_gpt.py runs first, before any collective),
and once end to end: pretrain_gpt.py alone, and under the launcher with 4 ranks.
"""
import json
import subprocess
import sys

import pytest

from megatron.arguments import parse_args
from tests.helpers.arguments import one_line_exit_2
from tests.helpers.flags import TINY_GPT
from tests.helpers.launch import REPO, bare_env, launch

BASE = TINY_GPT + ["--train-iters", "5"]

# (extra flags, world size, words the one-line message must contain)
BAD_COMBINATIONS = [
    (["--tensor-model-parallel-size", "3"], 6,
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
    (["--global-batch-size", "6"], 4,
     "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 4"),
    (["--pipeline-model-parallel-size", "8"], 8, "--pipeline-model-parallel-size 8 exceeds --num-layers 4"),
    (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible by tensor (2) x pipeline (1)"),
    (["--hidden-size", "30"], 1, "--hidden-size 30 is not divisible by --num-attention-heads 4"),
    (["--seq-length", "32"], 1, "--seq-length 32 exceeds --max-position-embeddings 16"),
    (["--fp16", "--bf16"], 1, "--fp16 and --bf16 cannot both be set"),
    (["--no-pipeline-parallel", "--pipeline-model-parallel-size", "2"], 2, "--no-pipeline-parallel needs"),
    # the profiler's flags are the patch set's (patches/to_megatron/megatron_flags.py): the same words as in
    # upstream's run
    (["--profile-flops-step", "0"], 1, "--profile-flops-step 0 must be >= 1"),
    (["--profile-flops-step", "-3"], 1, "--profile-flops-step -3 must be >= 1"),
    (["--profile-flops-step", "two"], 1, "argument --profile-flops-step: invalid int value: 'two'"),
    (["--profile-flops-step", "6"], 1, "--profile-flops-step 6 is beyond --train-iters 5"),
    (["--profile-flops-step", "2", "--profile-flops-output", "/proc/no/such/dir"], 1, "is not a writable directory"),
    (["--lr-decay-style", "square"], 1, "argument --lr-decay-style: invalid choice"),
    (["--pp-partition-memory-limit", "80XB"], 1, "--pp-partition-memory-limit 80XB: size '80XB' is not a size: give "
                                                 "a positive number of bytes"),
    (["--pp-partition-memory-limit", "-1"], 1, "--pp-partition-memory-limit -1: size '-1' is negative"),
    (["--pp-partition-memory-limit", "0"], 1, "--pp-partition-memory-limit 0: size '0' is zero"),
]


def run_direct(extra, world_size, tmp_path):
    env = bare_env(WORLD_SIZE=str(world_size), RANK="0")
    return subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py")] + BASE + [str(a) for a in extra],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def assert_one_line_exit_2(process, expected):
    lines = [line for line in process.stderr.splitlines() if line.startswith("error:")]
    assert process.returncode == 2, process.stderr[-2000:]
    assert len(lines) == 1, process.stderr[-2000:]
    assert expected in lines[0]
    assert "Traceback" not in process.stderr + process.stdout


@pytest.mark.parametrize("extra,world_size,expected", BAD_COMBINATIONS)
def test_bad_flags_exit_2_with_one_line(extra, world_size, expected, monkeypatch, capsys):
    assert expected in one_line_exit_2(BASE + extra, world_size, monkeypatch, capsys)


def test_the_output_directory_is_checked_without_being_made(tmp_path, monkeypatch, capsys):
    """A run refused at start leaves nothing behind; a directory that can be made is accepted (rank 0 makes it
    when it writes the report)."""
    output = tmp_path / "profiles" / "run1"
    refused = BASE + ["--profile-flops-step", "6", "--profile-flops-output", output]
    assert "--profile-flops-step 6 is beyond --train-iters 5" in one_line_exit_2(refused, 1, monkeypatch, capsys)
    monkeypatch.setenv("RANK", "0")
    args = parse_args([str(a) for a in BASE + ["--profile-flops-step", "2", "--profile-flops-output", output]],
                      world_size=1)
    assert args.profile_flops_output == str(output)
    assert list(tmp_path.iterdir()) == []  # neither refused nor accepted made a directory (nor left a probe)


def test_deepspeed_config_contradicting_flags(tmp_path, monkeypatch, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}))
    line = one_line_exit_2(BASE + ["--global-batch-size", "4", "--deepspeed", "--deepspeed_config", config], 1,
                           monkeypatch, capsys)
    assert "DeepSpeed config train_batch_size=8 contradicts the flags (which give 4" in line


@pytest.mark.parametrize("section,expected", [
    ({"enabled": True, "profile_stepp": 2}, "flops_profiler has unknown key 'profile_stepp'"),
    ({"enabled": "yes"}, "flops_profiler.enabled has the wrong type: str"),
    ({"enabled": True, "module_depth": 1.5}, "flops_profiler.module_depth has the wrong type: float"),
])
def test_bad_flops_profiler_section(section, expected, tmp_path, monkeypatch, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"flops_profiler": section}))
    assert expected in one_line_exit_2(BASE + ["--deepspeed", "--deepspeed_config", config], 1, monkeypatch, capsys)


@pytest.mark.launch
def test_every_launched_rank_exits_2_without_hanging(tmp_path):
    """Under the deepspeed launcher with 4 ranks, the launcher itself ends with code 2."""
    process = launch(REPO / "pretrain_gpt.py", 4, BASE + ["--global-batch-size", "6"], cwd=tmp_path, timeout=120)
    assert process.returncode == 2, process.stderr[-3000:]
    assert "Traceback" not in process.stderr + process.stdout
    assert (process.stderr + process.stdout).count("error: --global-batch-size 6 is not divisible by") == 1


@pytest.mark.launch
def test_corrupt_index_file_exits_2_before_any_collective(tmp_path):
    """End to end: pretrain_gpt.py alone, told it is one of 4 ranks, so reaching a collective would hang."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, data_file_path, index_file_path

    prefix = str(tmp_path / "corpus_text_document")
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix), dtype="uint16")
    builder.add_item([1, 2, 3])
    builder.end_document()
    builder.finalize(index_file_path(prefix))
    index = tmp_path / "corpus_text_document.idx"
    index.write_bytes(index.read_bytes()[:20])  # truncated
    vocab = REPO / "tools" / "demo_corpus"
    process = run_direct(["--data-path", prefix, "--vocab-file", vocab / "vocab.json",
                          "--merge-file", vocab / "merges.txt"], 4, tmp_path)
    assert_one_line_exit_2(process, str(index))
