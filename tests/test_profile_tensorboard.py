"""--tensorboard-dir: the profile's headline numbers as scalars at the profiled step, read back with
TensorBoard's own event reader."""
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from patches.profiler.files import profile_scalars
from patches.profiler.report import build_report
from tests.helpers.profiled_runs import PEAK_TFLOPS, PROFILE_STEP, profiled_run
from tests.helpers.schedules import schedule_context, schedule_entries


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return profiled_run(tmp_path_factory, "pp2_tp2_checkpointed")


@pytest.mark.launch
def test_profile_scalars_are_in_the_event_file(run):
    report = run.report
    events = EventAccumulator(str(run.tensorboard_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = profile_scalars(report)
    assert len(expected) == 10 + 1 + 2 * 7  # totals, ideal bubble, 7 per stage
    for tag, value in expected.items():
        assert tag in tags, tag
        # TensorBoard stores float32
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [(PROFILE_STEP, float(np.float32(value)))], tag
    totals = report["totals"]
    assert expected["flops-profile/mfu"] == totals["model_tflops_per_gpu"] / PEAK_TFLOPS
    assert expected["flops-profile/tflops-per-gpu"] == totals["tflops_per_gpu"]
    assert expected["flops-profile/iter-latency-s"] == totals["iter_latency_s"]
    for stage in report["stages"]:
        prefix = f"flops-profile/stage{stage['stage_id']}"
        assert expected[f"{prefix}/tflops-per-gpu"] == stage["tflops_per_gpu"]
        assert expected[f"{prefix}/bwd-latency-s"] == stage["bwd_latency_s"]
    # the per-stage TFLOPS average to the whole model's: both divide by the iteration latency
    assert sum(s["tflops_per_gpu"] for s in report["stages"]) / 2 == pytest.approx(totals["tflops_per_gpu"], rel=1e-12)
    # the training log's own scalars are still written at every iteration
    assert [e.step for e in events.Scalars("lm-loss-training/lm loss")] == [1, 2, 3]


def test_unknown_values_are_left_out():
    """No device peak, no sequence length known: no MFU, no tokens/s."""
    scalars = profile_scalars(build_report(schedule_entries(2, 4), schedule_context(2, 4, seq_length=None)))
    assert "flops-profile/mfu" not in scalars and "flops-profile/tokens-per-s" not in scalars
    assert "flops-profile/measured-over-analytic" not in scalars
    assert scalars["flops-profile/bubble-ideal-fraction"] == 0.2
    assert scalars["flops-profile/stage1/idle-fraction"] == 0.2
