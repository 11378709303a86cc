"""The pipeline-aware FLOPs profiler on the real PipelineEngine: pretrain_gpt.py --profile-flops-step."""
import json
import re

import pytest

from megatron.arguments import parse_args
from megatron.tokenizer.tokenizer import padded_vocab_size
from patches.formats.units import number_to_string
from patches.profiler.allocator_trace import INSTRUCTION_MARK, TRACE_DIRECTORY_VARIABLE, UNSEEN_FREE_MARK
from patches.profiler.files import validate_report
from patches.profiler.printed_stages import GC_LABEL
from patches.profiler.printer import HEADER
from patches.to_megatron.analytic_flops import upstream_flops_per_iteration
from tests.helpers.flags import PP2, PP2_TP2_CKPT, TINY_GPT, layout
from tests.helpers.golden import assert_report_as_golden, assert_text_as_golden
from tests.helpers.launch import REPO, TORCHRUN, explain, launch, run_pretrain
from tests.helpers.tiny_gpt import dense_params, expected_flops

pytestmark = pytest.mark.launch


@pytest.fixture(scope="module")
def profiled_directory(tmp_path_factory):
    return tmp_path_factory.mktemp("profiled")


@pytest.fixture(scope="module")
def profiled(profiled_directory):
    """pp 2 x tp 2, checkpointed, iteration 3 profiled; every rank also writes torch.profiler's own trace of the
    iteration where the memory was measured (torch_memory/)."""
    tmp = profiled_directory
    flags = PP2_TP2_CKPT + ["--profile-flops-step", "3", "--profile-flops-output", tmp / "profile"]
    (tmp / "torch_memory").mkdir()
    process, losses = run_pretrain(tmp, 4, flags, name="profiled",
                                   env={TRACE_DIRECTORY_VARIABLE: str(tmp / "torch_memory")}, via=TORCHRUN)
    assert process.returncode == 0, explain(process)
    report = json.loads((tmp / "profile" / "flops_profile_step3.json").read_text())
    return process, losses, report


def test_one_report_printed_once(profiled):
    process, _, report = profiled
    output = process.stdout + process.stderr
    assert output.count(HEADER) == 1
    assert output.count("Profile Summary at step 3:") == 1
    validate_report(report)
    assert report["step"] == 3
    assert report["parallelism"]["pipeline_parallel_size"] == 2 and report["parallelism"]["tensor_parallel_size"] == 2
    assert [stage["global_ranks"] for stage in report["stages"]] == [[0, 1], [2, 3]]


def test_flops_and_params_exact(profiled):
    _, _, report = profiled
    sequences = 2 * 4  # micro-batch size x micro-batches
    fwd, bwd, layer_fwd = expected_flops(4, sequences)
    totals = report["totals"]
    assert totals["fwd_flops"] == fwd
    assert totals["bwd_flops"] == bwd
    assert 2.0 <= totals["bwd_flops"] / totals["fwd_flops"] <= 2.25
    assert totals["recompute_flops"] == layer_fwd
    assert totals["params"] == dense_params(4)
    assert report["activation_checkpointing"] is True


def test_report_states_its_perturbation(profiled):
    """Iteration 3 profiled, its FLOPs counted in iteration 2; iteration 1, the only unprofiled one before it, is the
    warm-up: the report waits for iterations 4-6, the unprofiled time; the rates and the training log line's TFLOPs
    come from it, and the plan's times are scaled to it."""
    process, _, report = profiled
    totals, perturbation = report["totals"], report["perturbation"]
    unprofiled, profiled_s = perturbation["unprofiled_iter_s"], perturbation["profiled_iter_s"]
    assert perturbation["unprofiled_iterations"] == [4, 5, 6] and perturbation["baseline_note"] is None
    basis = report["partition_plan"]["basis"]
    paused = max(stage["gc"]["pause_s"] for stage in report["stages"])  # out of the layers' times: out of it too
    assert basis["iterations"] == [4, 5, 6] and basis["time_scale"] == unprofiled / (profiled_s - paused)
    assert basis["spread"] == perturbation["unprofiled_spread"] > 0 and basis["note"] is None
    output = process.stdout + process.stderr
    # printed after iteration 6 has run (its log line comes after the door's train step), before iteration 7's
    assert output.index(" iteration        5/") < output.index("Profile Summary at step 3:") \
        < output.index(" iteration        6/")
    assert unprofiled > 0 and profiled_s > 0
    assert perturbation["ratio"] == profiled_s / unprofiled
    assert totals["throughput_basis"] == "unprofiled" and totals["throughput_iter_s"] == unprofiled
    measured = totals["fwd_flops"] + totals["bwd_flops"] + totals["recompute_flops"]
    assert totals["tflops_per_gpu"] == measured / unprofiled / 4 / 1e12  # pp 2 x tp 2
    args = parse_args([str(a) for a in TINY_GPT + PP2_TP2_CKPT], world_size=4)
    args.padded_vocab_size = padded_vocab_size(args.synthetic_vocab_size, args)
    assert perturbation["log_line_flops"] == upstream_flops_per_iteration(args)
    assert perturbation["log_line_tflops"] == perturbation["log_line_flops"] / (unprofiled * 4) / 1e12
    assert f"perturbation = profiled / unprofiled:{' ' * 35}  {perturbation['ratio']:.3f}" in output
    assert perturbation["log_line_note"] in output


def test_report_as_before(profiled):
    """The JSON and the text are those this fixed run gave before (tests/data/golden/fork.*), times aside."""
    process, _, report = profiled
    assert_report_as_golden("fork", report)
    assert_text_as_golden("fork", process.stdout + process.stderr)
    # the garbage collector's pauses, which the golden run did not measure: every stage's, and their line
    for stage in report["stages"]:
        gc = stage["gc"]
        assert gc["collections"] >= gc["generation_2"] and 0 <= gc["in_compute_s"] <= gc["pause_s"], gc
        assert (gc["longest_s"] > 0) == (gc["collections"] > 0) and gc["longest_s"] <= gc["pause_s"], gc
    assert sum(GC_LABEL in line for line in process.stdout.splitlines()) == 1


def test_flops_are_counted_in_the_iteration_before(profiled):
    """--profile-flops-step 3 counts in iteration 2 (a dispatch mode), so iteration 3 runs without one; the
    same module calls ran in both; the start-up line and the report say so."""
    process, _, report = profiled
    counting = report["flops_counting"]
    assert counting["counted_iteration"] == 2 and counting["calls_differ"] == []
    assert counting["note"] == ("counted in iteration 2 by a dispatch mode, so that iteration 3 ran without one; it "
                                "ran the same module calls on inputs of the same shapes, phase by phase, on every rank")
    output = process.stdout + process.stderr
    assert "iteration 3 will be profiled on every stage, its FLOPs counted in iteration 2" in output
    assert counting["note"] in output


FP32 = 4
# Parameter tensors on a rank: the embedding's word and position tables, 12 per transformer layer (LayerNorm,
# QKV, dense, LayerNorm, fc1, fc2: a weight and a bias each), the final LayerNorm's 2, the tied embedding's 2 again.
PARAM_TENSORS = {0: 2 + 2 * 12, 1: 2 * 12 + 2 + 2}


def _torch_allocator_changes(events):
    """(time, bytes) of torch.profiler's exported CPU allocator events in time order (its "[memory]" events, the frees
    of blocks older than the profiler that the measurement marked), and, where an allocation comes at the address of
    a block allocated in the trace and not freed in it, that block's free first: torch.profiler records no free made
    on another thread, and the allocator hands out no address still allocated."""
    changes = []
    for event in events:
        if event.get("name") == "[memory]" and event["args"]["Device Type"] == 0:
            changes.append((event["ts"], event["args"]["Addr"], event["args"]["Bytes"]))
        elif event.get("name", "").startswith(UNSEEN_FREE_MARK):
            changes.append((event["ts"], None, -int(event["name"][len(UNSEEN_FREE_MARK):])))
    live, inferred = {}, []
    for ts, address, change in sorted(changes, key=lambda c: (c[0], c[2])):  # at one instant, frees first
        if address is not None and change > 0:
            if address in live:
                inferred.append((ts, -live[address]))
            live[address] = change
        elif address is not None:
            live.pop(address, None)
        inferred.append((ts, change))
    return inferred


def _torch_allocator_levels(path):
    """(the highest rise above the start, the change at the end) of torch.profiler's exported CPU allocator events."""
    level = highest = 0
    for _, change in _torch_allocator_changes(json.loads(path.read_text())["traceEvents"]):
        level += change
        highest = max(highest, level)
    return highest, level


def _torch_allocator_high_in_last_instruction(path):
    """The highest level above the start of torch.profiler's exported CPU allocator events while the iteration's
    last instruction ran (its OptimizerStep), by the measurement's marks in the same trace."""
    events = json.loads(path.read_text())["traceEvents"]
    marks = [event for event in events if event.get("name", "").startswith(INSTRUCTION_MARK)]
    last = max(marks, key=lambda event: int(event["name"][len(INSTRUCTION_MARK):]))
    start, end = last["ts"], last["ts"] + last["dur"]
    level, highest = 0, None
    for ts, change in _torch_allocator_changes(events):
        if ts > end:
            break
        if ts >= start and highest is None:
            highest = level
        level += change
        if ts >= start:
            highest = max(highest, level)
    return level if highest is None else highest


def test_memory_per_stage_against_torchs_allocator(profiled, profiled_directory):
    """Measured in iteration 2 (where the FLOPs were counted): the static bytes exactly what fp32 Adam without ZeRO
    holds; the measured peak what torch's own exported allocator events say; the predicted peak within 10% of it."""
    _, _, report = profiled
    for stage in report["stages"]:
        memory, params = stage["memory"], stage["params_per_gpu"]  # tp ranks hold equal shares
        assert memory["iteration"] == 2 and memory["basis"].startswith("torch.profiler memory events")
        assert memory["param_bytes"] == params * FP32 and memory["grad_bytes"] == params * FP32
        # Adam's two moments per element, and a step count (an fp32 scalar) per parameter tensor
        assert memory["optimizer_bytes"] == 2 * params * FP32 + PARAM_TENSORS[stage["stage_id"]] * FP32
        assert memory["optimizer_created_bytes"] == 0  # iteration 1 made Adam's state
        assert memory["in_flight_micro_batches"] == 2 - stage["stage_id"]  # 1F1B: min(pp - s, micro-batches)
        rise, change = _torch_allocator_levels(
            profiled_directory / "torch_memory" / f"torch_memory_rank{memory['global_rank']}.json")
        assert memory["measured_peak_bytes"] == memory["start_bytes"] + rise
        # the optimizer's own step: its highest level above base and state (the gradients, gone at the start)
        optimizer_high = memory["start_bytes"] + _torch_allocator_high_in_last_instruction(
            profiled_directory / "torch_memory" / f"torch_memory_rank{memory['global_rank']}.json")
        assert memory["optimizer_step_transient_bytes"] == optimizer_high - memory["base_bytes"] \
            - memory["state_bytes"] > 0
        assert memory["optimizer_step_transient_bytes"] <= memory["step_transient_bytes"]
        assert memory["end_bytes"] == memory["start_bytes"] + change
        measured = memory["measured_peak_bytes"]
        assert abs(memory["predicted_peak_bytes"] - measured) <= 0.1 * measured, (stage["stage_id"], memory)
    hidden = 2 * 16 * 32 * FP32  # micro-batch x sequence x hidden, fp32
    layers = {row["index"]: row for row in report["layers"]}
    for index in (1, 2, 3, 4):  # checkpointed: each keeps its input only
        assert layers[index]["activation_bytes"] == hidden
    assert layers[5]["activation_bytes"] == hidden + 2 * (2 * 16 * FP32)  # LayerNorm: its input, mean and rstd
    for stage in report["stages"]:
        rows = [row for row in layers.values() if row["stage"] == stage["stage_id"]]
        assert sum(row["state_bytes"] for row in rows) == stage["memory"]["state_bytes"]


def _walk(node):
    yield node
    for child in node["children"]:
        yield from _walk(child)


def test_module_trees_are_inclusive(profiled):
    _, _, report = profiled
    for stage in report["stages"]:
        for node in _walk(stage["modules"]):
            if not node["children"]:
                continue
            for kind in ("fwd", "bwd", "recompute"):
                assert sum(c[f"{kind}_flops"] for c in node["children"]) <= node[f"{kind}_flops"], node["name"]
                children_s = sum(c[f"{kind}_latency_s"] for c in node["children"])
                assert children_s <= node[f"{kind}_latency_s"] + 1e-3, (node["name"], kind)


def test_every_stage_times_its_instructions(profiled):
    _, _, report = profiled
    for stage in report["stages"]:
        instructions = stage["instructions"]
        assert instructions["BackwardPass"]["total_s"] > 0
        assert instructions["ForwardPass"]["count"] == 4 and instructions["BackwardPass"]["count"] == 4
        assert instructions["OptimizerStep"]["count"] == 1
        covered = sum(i["total_s"] for i in instructions.values())
        assert covered >= 0.95 * stage["train_batch_latency_s"], stage["stage_id"]


def test_profiling_leaves_losses_bitwise_identical(profiled, pp2_tp2_plain_run):
    _, profiled_losses, _ = profiled
    _, plain_losses = pp2_tp2_plain_run
    assert sorted(plain_losses) == list(range(1, 21))
    assert plain_losses == profiled_losses  # float equality on every iteration, profiled one included


def test_no_recompute_without_checkpointing_and_the_flag_wins_over_the_config(tmp_path):
    """No --checkpoint-activations: recompute is 0 everywhere. The config section is also enabled
    (its profile_step 1 is iteration 2): the flag's iteration 1 is the only one profiled. pp 2 x tp 1 (2 ranks):
    neither check depends on the tensor split, which the profiled run above has."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"flops_profiler": {"enabled": True, "profile_step": 1}}))
    flags = PP2 + ["--train-iters", "2", "--profile-flops-step", "1", "--profile-flops-output", tmp_path,
                       "--deepspeed", "--deepspeed_config", config]
    process, _ = run_pretrain(tmp_path, 2, flags, via=TORCHRUN)
    assert process.returncode == 0, explain(process)
    output = process.stdout + process.stderr
    assert output.count(HEADER) == 1 and "Profile Summary at step 1:" in output
    assert "--profile-flops-step 1 takes precedence over the DeepSpeed config's flops_profiler section" in output
    report = json.loads((tmp_path / "flops_profile_step1.json").read_text())
    assert report["activation_checkpointing"] is False
    for stage in report["stages"]:
        assert all(node["recompute_flops"] == 0 and node["recompute_latency_s"] == 0
                   for node in _walk(stage["modules"]))
    fwd, bwd, _ = expected_flops(4, 8)
    totals = report["totals"]
    assert (totals["fwd_flops"], totals["bwd_flops"], totals["recompute_flops"]) == (fwd, bwd, 0)
    assert report["flops_counting"]["counted_iteration"] == 1  # no iteration before it to count in


@pytest.mark.parametrize("counting, counted", [("previous", 1), ("profiled", 2)])
def test_plain_deepspeed_engine_gets_the_same_report(tmp_path, counting, counted):
    """--no-pipeline-parallel: a DeepSpeedEngine (pp=1, tp=2), profiled by the same flag, its FLOPs counted in
    the iteration before (the default) or in the profiled one itself."""
    flags = ["--no-pipeline-parallel"] + layout(tp=2) + ["--global-batch-size", "8",
             "--train-iters", "2", "--profile-flops-step", "2", "--profile-flops-output", tmp_path,
             "--profile-flops-counting", counting]
    process, _ = run_pretrain(tmp_path, 2, flags, via=TORCHRUN)
    assert process.returncode == 0, explain(process)
    assert (process.stdout + process.stderr).count(HEADER) == 1
    report = json.loads((tmp_path / "flops_profile_step2.json").read_text())
    validate_report(report)
    fwd, bwd, _ = expected_flops(4, 8)
    assert (report["totals"]["fwd_flops"], report["totals"]["bwd_flops"]) == (fwd, bwd)
    assert report["stages"][0]["instructions"]["BackwardPass"]["count"] == 4
    assert report["flops_counting"]["counted_iteration"] == counted
    assert report["flops_counting"]["calls_differ"] == []
    if counting == "previous":  # as this fixed run gave before, times aside
        assert_report_as_golden("plain_engine", report)
        assert_text_as_golden("plain_engine", process.stdout + process.stderr)


def test_config_section_on_a_plain_pipeline_module(tmp_path):
    """3 stages, a tied layer, DeepSpeed's flops_profiler section: one report, its FLOPs counted the batch before,
    and no 0.19.8 crash."""
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "flops_profiler": {"enabled": True, "profile_step": 2, "module_depth": -1, "top_modules": 2,
                                 "detailed": True}}
    config_path = tmp_path / "ds_config.json"
    config_path.write_text(json.dumps(config))
    process = launch(REPO / "tests" / "scripts" / "plain_pipeline.py", 3, [config_path], cwd=tmp_path, via=TORCHRUN)
    assert process.returncode == 0, explain(process)
    output = process.stdout + process.stderr
    assert output.count(HEADER) == 1
    assert "Profile Summary at step 2:" in output
    assert "bwd_microstep timer has already been started" not in output
    # The batch before (global step 1) counted the FLOPs, as --profile-flops-step does: 4 micro-batches of 2
    # through 4 Linear products of 16 x 16 (the tied one twice), 2 FLOPs a multiply-add.
    assert ("counted in iteration 1 by a dispatch mode, so that iteration 2 ran without one; it ran the same "
            "module calls on inputs of the same shapes, phase by phase, on every rank") in output
    fwd = 4 * 4 * 2 * (2 * 16 * 16)
    assert re.search(r"fwd flops of model:\s+" + re.escape(number_to_string(fwd)) + r"\s*$", output, re.M), output
    assert_text_as_golden("section", output)  # as this fixed run printed it before, times aside
    # the script wraps train_batch on the instance, as a library may: no recursion, and nothing the patches
    # keep (the section's schedule, the engine registry) holds the engine once the script lets go of it
    assert "engine freed: True" in output


def test_config_section_on_a_plain_deepspeed_engine(tmp_path):
    """pp=1: the section gives the same gathered report (both data-parallel ranks profiled, one printed); the
    script's checkpoint, saved without a client state and loaded, goes through the patched save and load."""
    report_file = tmp_path / "flops_report.txt"
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "steps_per_print": 1000,
              "flops_profiler": {"enabled": True, "profile_step": 1, "detailed": False,
                                 "output_file": str(report_file)}}
    config_path = tmp_path / "ds_config.json"
    config_path.write_text(json.dumps(config))
    process = launch(REPO / "tests" / "scripts" / "plain_engine.py", 2, [config_path], cwd=tmp_path, via=TORCHRUN)
    assert process.returncode == 0, explain(process)
    text = report_file.read_text()
    assert text.count(HEADER) == 1 and "Profile Summary at step 1:" in text
    assert HEADER not in process.stdout + process.stderr  # output_file honoured
    assert "Detailed Profile" not in text  # detailed: false honoured
    # One replica, 2 micro-batches of 2 samples, two Linear layers of 32 x 128: 2 flops per MAC.
    fwd = 2 * (2 * 2 * 32 * 128) * 2
    assert re.search(r"fwd flops of model:\s+" + re.escape(number_to_string(fwd)) + r"\s*$", text, re.M), text
    assert re.search(r"ForwardPass\s+2\s", text) and re.search(r"BackwardPass\s+2\s", text)
    assert (tmp_path / "checkpoint" / "global_step3").is_dir()  # the patched save_checkpoint, no client state


def test_shapes_that_change_unforeseen_are_counted_in_the_iteration_reported(tmp_path):
    """Batches that grow by 2 tokens an iteration, nothing in the config saying so: the section counts in batch
    1, batch 2 turns out to run other shapes, so no figure of batch 1 is printed for it; batch 3 is profiled
    instead, counting in itself, and its FLOPs are exact for its 10 tokens."""
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "flops_profiler": {"enabled": True, "profile_step": 2, "detailed": False}}
    config_path = tmp_path / "ds_config.json"
    config_path.write_text(json.dumps(config))
    process = launch(REPO / "tests" / "scripts" / "growing_sequence.py", 2, [tmp_path, config_path], cwd=tmp_path,
                     via=TORCHRUN)
    assert process.returncode == 0, explain(process)
    output = process.stdout + process.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    report, seq = result["report"], result["seq_lengths"][3]
    assert output.count(HEADER) == 1 and "Profile Summary at step 3:" in output
    assert "> FLOPs profiler (patches): iteration 2 ran other module calls or input shapes than iteration 1, where " \
           "its FLOPs were counted (" in output and "profiling iteration 3 instead, its FLOPs counted in it" in output
    counting = report["flops_counting"]
    assert (report["step"], counting["counted_iteration"], counting["calls_differ"]) == (3, 3, [])
    assert counting["note"].startswith("counted in iteration 3 itself, by a dispatch mode on its timed path "
                                       "(iteration 2 ran other module calls or input shapes than iteration 1")
    gemm = 2 * 2 * seq * 16 * 16  # one Linear(16, 16) over one micro-batch of 2 sequences
    # 4 micro-batches; forward 2 linears; backward their weight gradients and the second's input gradient
    assert (report["totals"]["fwd_flops"], report["totals"]["bwd_flops"]) == (4 * 2 * gemm, 4 * 3 * gemm)
    # iteration 1 counted and iteration 2 was profiled: neither is an unprofiled baseline
    assert report["perturbation"]["unprofiled_iterations"] == [0]
