"""DeepSpeed stays DeepSpeed: public-API scenarios trained twice, by stock DeepSpeed (the flops_profiler
section off) and with patches.apply() and the section on. Losses must match bit for bit and the profile
must be there. All scenarios share two launches (tests/scripts/compat_scenarios.py); the 4-stage conv
check is a third. fp16 (dynamic loss scaling) is absent: DeepSpeed's CPU accelerator has no fp16, so the
report's optimizer_step_skipped is tested on synthetic measurements (test_flop_coverage.py)."""
import json

import pytest

from patches.profiler.printer import HEADER
from tests.helpers.launch import REPO, TORCHRUN, explain, launch

pytestmark = pytest.mark.launch

SCRIPT = REPO / "tests" / "scripts" / "compat_scenarios.py"
SCENARIOS = ["ds_unit_one_layer", "plain_no_steps_per_print", "plain_wall_clock", "plain_zero1", "plain_zero2",
             "pipe_no_steps_per_print", "pipe_wall_clock", "pipe_bf16", "pipe_zero1", "pipe_training_data",
             "pipe_eval_on_profiled_step", "pipe_functions", "pipe_conv", "pipe_checkpointing"]
# Autotuning exits the process after its last profiled step: it goes last and writes only its metric.
LAUNCHED = SCENARIOS + ["plain_autotuning"]
PRINTED = [name for name in SCENARIOS if name != "ds_unit_one_layer"]
NPROCS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = {}
    for mode in ("stock", "patched"):
        out = tmp_path_factory.mktemp(mode)
        process = launch(SCRIPT, NPROCS, [out, mode] + LAUNCHED, cwd=out, via=TORCHRUN)
        assert process.returncode == 0, explain(process)
        results[mode] = out
    return results


def _result(runs, mode, name, rank=0):
    return json.loads((runs[mode] / f"{name}.rank{rank}.json").read_text())


@pytest.mark.parametrize("name", SCENARIOS)
def test_losses_bitwise_identical(runs, name):
    for rank in range(NPROCS):
        assert _result(runs, "patched", name, rank)["losses"] == _result(runs, "stock", name, rank)["losses"]


@pytest.mark.parametrize("name", PRINTED)
def test_profile_printed(runs, name):
    text = (runs["patched"] / f"{name}.profile.txt").read_text()
    assert text.count(HEADER) == 1 and "Profile Summary at step 2:" in text


def _profiler(runs, name):
    numbers = [_result(runs, "patched", name, rank)["profiler"] for rank in range(NPROCS)]
    assert all(n == numbers[0] for n in numbers), numbers  # gathered: the same on every rank
    return numbers[0]


def test_deepspeed_unit_test_of_its_profiler(runs):
    """DeepSpeed's own test (one Linear(10, 10), batch 1, section on): flops ~ 200 and params == 110 on
    its rank 0. Ours are exact, on every rank; DeepSpeed's own profiler, in the stock run, agrees."""
    numbers = _profiler(runs, "ds_unit_one_layer")
    assert numbers["attributes"] == [200, 100, 110]  # engine.flops_profiler.flops, .macs, .params
    assert (numbers["flops"], numbers["macs"], numbers["params"]) == (200, 100, 110)
    assert numbers["flops_string"] == "200 FLOPS" and numbers["duration"] > 0
    stock = _result(runs, "stock", "ds_unit_one_layer")["profiler"]
    assert abs(stock["attributes"][0] - 200) / 200 < 0.05 and stock["attributes"][2] == 110


def test_engine_flops_profiler_gives_whole_model_values(runs):
    # pipeline: two Linear(8, 8) on two stages, 2 micro-batches of 2; plain: Linear(8, 16), Linear(16, 8)
    pipe = _profiler(runs, "pipe_no_steps_per_print")
    assert (pipe["flops"], pipe["macs"], pipe["params"]) == (2 * 2 * 8 * 8 * 2 * 2, 512, 2 * (8 * 8 + 8))
    plain = _profiler(runs, "plain_no_steps_per_print")
    assert (plain["flops"], plain["params"]) == (2 * 2 * (8 * 16 * 2) * 2, 8 * 16 + 16 + 16 * 8 + 8)


def test_conv_pipeline_matches_flop_counter_mode_two_stages(runs):
    """Convolutions, pooling and a function layer on 2 stages: fwd and bwd equal torch's FlopCounterMode
    over the same layers in one process."""
    numbers = _profiler(runs, "pipe_conv")
    assert numbers["reference"]["fwd_flops"] > 0
    assert {key: numbers["totals"][key] for key in ("fwd_flops", "bwd_flops")} == numbers["reference"]


def test_conv_pipeline_matches_flop_counter_mode_four_stages(tmp_path):
    process = launch(SCRIPT, 4, [tmp_path, "patched", "pipe_conv"], cwd=tmp_path, via=TORCHRUN)
    assert process.returncode == 0, explain(process)
    numbers = [json.loads((tmp_path / f"pipe_conv.rank{rank}.json").read_text())["profiler"] for rank in range(4)]
    assert all(n == numbers[0] for n in numbers)
    assert {key: numbers[0]["totals"][key] for key in ("fwd_flops", "bwd_flops")} == numbers[0]["reference"]


def test_autotuning_metric_uses_measured_fwd_and_bwd(runs):
    """DeepSpeed's autotuner writes FLOPS_per_gpu = engine.flops * gas / latency. Its own profiler puts
    3x one forward in engine.flops; ours the measured forward + backward of one micro-batch."""
    def engine_flops(mode):
        metric = json.loads((runs[mode] / "plain_autotuning.metric.json").read_text())
        return metric["FLOPS_per_gpu"] * metric["latency"] / (1_000_000 * 2)  # 2 micro-batches per step

    # Linear(8, 16), Linear(16, 8) on 2 samples: fwd 2 GEMMs; bwd 1 for the first layer (its input needs
    # no gradient) and 2 for the second.
    fwd = 2 * 2 * (8 * 16 + 16 * 8)
    bwd = 2 * 2 * 8 * 16 + 2 * (2 * 2 * 16 * 8)
    assert engine_flops("patched") == pytest.approx(fwd + bwd, rel=1e-9)
    assert engine_flops("stock") == pytest.approx(3 * fwd, rel=0.05)
