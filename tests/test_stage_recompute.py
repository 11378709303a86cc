"""Activation recompute per pipeline stage (--pp-recompute-layers K0,K1: stage s recomputes the first K_s of its
transformer layers, each its own checkpoint; patches/partition/recompute.py, patches/to_deepspeed/stage_recompute.py).

The tiny GPT's specs are [embedding, 1, 2, 3, 4, final norm, LM head]; on pp 2 stage 0 holds [embedding, 1, 2] and
stage 1 [3, 4, final norm, LM head]. By hand:
    2,1 -> layers 1, 2 (stage 0) and 3 (stage 1)
    0,2 -> layers 3, 4
    1,3 -> layer 1, and 3, 4: stage 1 holds 2 transformer layers, not 3 (the report and the log say so)
The report's recompute FLOPs must be those layers' forwards, as counted apart from the profiler (a global forward
hook, tests/scripts/count_recomputed_layers.py), and the analytic figure must follow the same layers. Dropout off,
losses are bitwise those of no recompute.
"""
import json
import re

import pytest

from megatron.arguments import parse_args
from megatron.model.gpt_model import pipeline_stage_layers
from patches.formats.units import number_to_string
from patches.partition.report_plan import PlanRequest, plan_of
from patches.profiler.files import validate_report
from patches.to_megatron.analytic_flops import gpt_flops_per_iteration, recompute_shortfall
from tests.helpers.flags import TINY_GPT, layout
from tests.helpers.launch import REPO, TORCHRUN, explain, launch, read_losses
from tests.helpers.recompute_count import recompute_calls
from tests.helpers.tiny_gpt import expected_flops

LAYERS, MICRO_BATCHES, SEQUENCES = 4, 4, 8  # global batch 8 of micro-batches of 2
SEQ_LENGTH, MICRO_BATCH_SIZE, HIDDEN = 16, 2, 32  # tests/helpers/flags.py's TINY_GPT
LAYER_FWD = expected_flops(LAYERS, SEQUENCES)[2] // LAYERS  # one layer's forward over the iteration
RUNS = {"2,1": [1, 2, 3], "0,2": [3, 4], "1,3": [1, 3, 4]}  # --pp-recompute-layers: the layers recomputed, by hand
# the report's line, by layer index in the PipelineModule (0: the embedding)
PRINTED = {"2,1": "stage 0: layers 1, 2 of 3; stage 1: layer 3 of 4",
           "0,2": "stage 0: none of 3; stage 1: layers 3, 4 of 4",
           "1,3": "stage 0: layer 1 of 3; stage 1: layers 3, 4 of 4"}
SHORT_1_3 = ("--pp-recompute-layers 1,3: a stage recomputes every transformer layer it holds where it holds fewer "
             "than asked: stage 1 holds 2, not 3")
BASE = TINY_GPT + layout(pp=2) + ["--global-batch-size", "8"]


def _args(counts):
    args = parse_args(BASE + ["--train-iters", "1", "--pp-recompute-layers", counts], world_size=2)
    args.padded_vocab_size = 192
    args.num_micro_batches = MICRO_BATCHES
    return args


# ---------------------------------------------------------------- in process: the flag, the analytic, the line
@pytest.mark.parametrize("counts", RUNS)
def test_analytic_recompute_follows_the_layers_by_hand(counts):
    args = _args(counts)
    assert args.pp_recompute_layers == tuple(int(k) for k in counts.split(","))
    analytic = gpt_flops_per_iteration(args, stage_layers=pipeline_stage_layers(args))
    assert analytic["recompute_flops"] == len(RUNS[counts]) * LAYER_FWD


def test_a_stage_asked_for_more_layers_than_it_holds_is_said():
    assert recompute_shortfall(_args("1,3"), pipeline_stage_layers(_args("1,3"))) == SHORT_1_3
    assert recompute_shortfall(_args("2,1"), pipeline_stage_layers(_args("2,1"))) is None


@pytest.mark.parametrize("flags, message", [
    (["--pp-recompute-layers", "1"], "--pp-recompute-layers 1 names 1 pipeline stages; "
                                     "--pipeline-model-parallel-size is 2"),
    (["--pp-recompute-layers", "1,x"], "--pp-recompute-layers '1,x': give one count of layers per pipeline stage"),
    (["--pp-recompute-layers", "1,-1"], "--pp-recompute-layers '1,-1': a stage cannot recompute a negative number"),
    (["--pp-recompute-layers", "1,1", "--checkpoint-activations"],
     "--pp-recompute-layers and --checkpoint-activations or --recompute-granularity cannot both be given"),
    (["--pp-recompute-layers", "1,1", "--recompute-granularity", "selective"],
     "--pp-recompute-layers and --checkpoint-activations or --recompute-granularity cannot both be given"),
    (["--pp-recompute-layers", "1,1", "--no-pipeline-parallel", "--pipeline-model-parallel-size", "1"],
     "--pp-recompute-layers and --no-pipeline-parallel cannot both be given"),
])
def test_a_bad_or_conflicting_flag_is_one_line_and_exit_2(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(BASE + ["--train-iters", "1"] + flags, world_size=2)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {message}") and error.count("\n") == 1


# ---------------------------------------------------------------- launched: what really ran again
_runs = {}


def _run(name, flags, tmp_path_factory, processes=2):
    """One launch of tests/scripts/count_recomputed_layers.py, profiled at 1 (shared by the tests below):
    (output, report, {layer: recompute calls summed over ranks}, losses)."""
    if name not in _runs:
        tmp = tmp_path_factory.mktemp("recompute")
        argv = BASE + flags + ["--train-iters", "2", "--profile-flops-step", "1", "--profile-flops-output", tmp,
                               "--loss-record-file", tmp / "losses.jsonl"]
        process = launch(REPO / "tests" / "scripts" / "count_recomputed_layers.py", processes, argv, cwd=tmp,
                         via=TORCHRUN)
        assert process.returncode == 0, explain(process)
        output = process.stdout + process.stderr
        calls = recompute_calls(output)
        _runs[name] = (output, json.loads((tmp / "flops_profile_step1.json").read_text()), calls,
                       read_losses(tmp / "losses.jsonl"))
    return _runs[name]


@pytest.mark.launch
@pytest.mark.parametrize("counts", RUNS)
def test_recompute_flops_are_the_layer_forwards_that_ran_again(counts, tmp_path_factory):
    output, report, calls, _ = _run(counts, ["--pp-recompute-layers", counts], tmp_path_factory)
    recomputed = RUNS[counts]
    # the hook's count, apart from the profiler: iterations 1 and 2, every micro-batch
    assert calls == {layer: 2 * MICRO_BATCHES for layer in recomputed}
    validate_report(report)
    fwd, bwd, _ = expected_flops(LAYERS, SEQUENCES)
    totals = report["totals"]
    assert (totals["fwd_flops"], totals["bwd_flops"]) == (fwd, bwd)
    assert totals["recompute_flops"] == len(recomputed) * LAYER_FWD
    assert totals["analytic"]["recompute_flops"] == totals["recompute_flops"]
    assert report["activation_checkpointing"] is True
    assert [row["index"] for row in report["layers"] if row["recompute_flops"]] == recomputed  # the table's rows
    assert report["recompute_note"] == (SHORT_1_3 if counts == "1,3" else None)
    assert re.search(rf"^layers recomputed, per stage:\s+{re.escape(PRINTED[counts])}$", output, re.M)
    if counts == "1,3":  # said at start-up and in the report
        assert output.count(f"> {SHORT_1_3}\n") == 1
        assert re.search(rf"^recomputed layers:\s+{re.escape(SHORT_1_3)}$", output, re.M)


@pytest.mark.launch
def test_losses_are_those_of_no_recompute_with_dropout_off(tmp_path_factory):
    """The tiny GPT trains without dropout: whichever layers recompute, every loss is bitwise the run's without
    recompute (upstream's tier holds per-stage recompute against DeepSpeed's own, with dropout on)."""
    none = _run("none", [], tmp_path_factory)
    assert none[2] == {} and len(none[3]) == 2
    for counts in RUNS:
        assert _run(counts, ["--pp-recompute-layers", counts], tmp_path_factory)[3] == none[3], counts


@pytest.mark.launch
def test_a_plain_pipeline_module_recomputes_per_stage_by_the_environment(tmp_path):
    """tests/scripts/plain_pipeline.py (no Megatron): 3 stages of [tied Linear, Linear] [ReLU, Linear] [ReLU, tied
    head]; $DS_PIPE_RECOMPUTE_LAYERS=0,1,0 recomputes stage 1's Linear alone (DeepSpeed's rule for a model of its
    own: a layer with parameters), 4 micro-batches of 2 through 16 x 16, and trains as without it."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                                  "flops_profiler": {"enabled": True, "profile_step": 2, "detailed": False}}))
    script = REPO / "tests" / "scripts" / "plain_pipeline.py"
    runs = {}
    for counts in ("0,1,0", None):
        env = {"DS_PIPE_RECOMPUTE_LAYERS": counts} if counts else {}
        process = launch(script, 3, [config], cwd=tmp_path, via=TORCHRUN, env=env)
        assert process.returncode == 0, explain(process)
        runs[counts] = process.stdout + process.stderr
    recompute = 4 * 2 * (2 * 16 * 16)
    line = r"recompute flops of model:\s+{}\s*$"
    assert re.search(line.format(re.escape(number_to_string(recompute))), runs["0,1,0"], re.M), runs["0,1,0"]
    assert re.search(line.format("0"), runs[None], re.M), runs[None]
    final = re.compile(r"^final loss .*$", re.M)
    assert final.search(runs["0,1,0"]).group() == final.search(runs[None]).group()


@pytest.mark.launch
def test_each_layer_is_measured_both_ways_whether_it_recomputed_or_not(tmp_path_factory):
    """Layer 1 recomputes under 2,1 and not under 0,2, layer 4 the other way round: each transformer layer's bytes
    kept whole and kept as a checkpoint (its input: a micro-batch's hidden states) are the same from either run."""
    first, second = (_run(counts, ["--pp-recompute-layers", counts], tmp_path_factory)[1]["layers"]
                     for counts in ("2,1", "0,2"))
    hidden = SEQ_LENGTH * MICRO_BATCH_SIZE * HIDDEN * 4  # fp32
    for one, other in zip(first, second):
        if one["type"] != "ParallelTransformerLayerPipe":
            continue
        assert one["kept_as_checkpoint_bytes"] == other["kept_as_checkpoint_bytes"] == hidden, one["index"]
        assert one["kept_whole_bytes"] == other["kept_whole_bytes"] > hidden, one["index"]
        recomputed = one if one["recompute_flops"] else other
        assert recomputed["activation_bytes"] == hidden  # a checkpointed layer keeps its input only


def _planned_limit(report):
    """A memory limit under which the report's plan recomputes some layers, not all, and fits: (limit, the plan)."""
    roomy = plan_of(report, PlanRequest(limit=10 ** 12, limit_source="flag"))["recompute_plan"]
    assert roomy["recompute_layers"] == [0, 0]  # nothing need recompute
    for percent in range(95, 40, -5):
        limit = max(roomy["predicted_peak_bytes"]) * percent // 100
        chosen = plan_of(report, PlanRequest(limit=limit, limit_source="flag"))["recompute_plan"]
        if chosen["memory_fits"] and 0 < sum(chosen["recompute_layers"]) < LAYERS:
            return limit, chosen
    raise AssertionError("no limit between recomputing nothing and everything")


@pytest.mark.launch
def test_the_profiles_plan_applies_the_recompute_it_chose_with_the_parts(tmp_path_factory):
    """Profiled with every layer recomputed, the report plans under a limit that only some recompute meets; a run cut
    by it (--pp-partition-from-profile, --pp-partition-memory-limit) recomputes exactly those layers, says so at
    start-up, reports their FLOPs and trains as without recompute (dropout off)."""
    _, report, _, _ = _run("every", ["--checkpoint-activations", "--checkpoint-num-layers", "1"], tmp_path_factory)
    path = tmp_path_factory.mktemp("plan") / "every.json"
    path.write_text(json.dumps(report))
    limit, chosen = _planned_limit(report)
    counts = ",".join(map(str, chosen["recompute_layers"]))
    output, planned, calls, losses = _run(f"planned {limit}", [
        "--checkpoint-activations", "--pp-partition-from-profile", str(path), "--pp-partition-memory-limit",
        str(limit)], tmp_path_factory)
    assert (f"parts {chosen['parts']}, planned from its measured layers, each stage recomputing its first {counts} "
            "recomputable layers") in output
    expected = []
    for stage, count in enumerate(chosen["recompute_layers"]):
        held = [row["index"] for row in planned["layers"] if row["stage"] == stage
                and row["type"] == "ParallelTransformerLayerPipe"]
        expected += held[:count]
    assert planned["partition_plan"]["current_parts"] == chosen["parts"]
    assert sorted(calls) == expected and set(calls.values()) == {2 * MICRO_BATCHES}  # layer numbers = indices here
    assert planned["totals"]["recompute_flops"] == len(expected) * LAYER_FWD
    assert planned["totals"]["analytic"]["recompute_flops"] == planned["totals"]["recompute_flops"]
    assert losses == _run("none", [], tmp_path_factory)[3]
