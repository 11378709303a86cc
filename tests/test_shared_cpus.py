"""A CPU run whose ranks share fewer CPUs than they run threads (patches/profiler/shared_cpus.py,
patches/partition/planner.py: SharedCpus): the share of their compute time the stages ran, from the replica's
instruction events, by hand; when it is not measured; and the schedule run on the CPUs they share
(partition/shared_schedule.py), in the planner, a saved report's plan and its recompute what-if. In process."""
import copy
import dataclasses
import json
from pathlib import Path

import pytest

from patches.partition.measured_run import MeasuredRun
from patches.partition.plan_lines import plan_line, what_if_line
from patches.partition.planner import LayerCost, SharedCpus, model_iter_s, predict
from patches.partition.report_plan import PlanRequest, plan_of
from patches.partition.report_recompute import recompute_what_if
from patches.partition.shared_schedule import running_rate, schedule_order, shared_cpus_iter_s
from patches.partition.what_if import what_if_model
from patches.profiler.shared_cpus import shared_cpus_of

GOLDEN = Path(__file__).resolve().parent / "data" / "golden" / "fork.report.json"


def entry(stage, events, host="h", cpus=(0, 1), threads=1, host_ranks=None, offset=0.0):
    return {"stage_id": stage, "events": [(name, {}, start, end) for name, start, end in events],
            "clock_offset_s": offset, "host": host, "cpus": list(cpus), "threads": threads, "host_ranks": host_ranks}


def four_ranks(**where):
    """Four ranks of one thread on two CPUs: all four compute in [0, 1) (each runs half of it), rank 0 alone in
    [1, 2) (all of it), and a message instruction that is not compute."""
    return [entry(0, [("ForwardPass", 0.0, 1.0), ("BackwardPass", 1.0, 2.0), ("SendActivation", 2.0, 3.0)], **where),
            entry(1, [("ForwardPass", 0.0, 1.0)], **where),
            entry(2, [("BackwardOnlyPass", 0.0, 0.5), ("WeightPass", 0.5, 1.0)], **where),
            entry(3, [("ForwardPass", 0.0, 1.0)], **where)]


def test_the_share_by_hand():
    # running: 4 ranks x 1 s at 2/4 of a CPU each (2 s of work in 4 s), then 1 rank x 1 s whole: 3 / 5
    # forward: ranks 0, 1 and 3 a second each, of 5 s of compute instructions
    assert shared_cpus_of(four_ranks(), tp=1, dp=1, device_name="cpu") == SharedCpus(
        cpus=2, ranks=4, threads=1, ranks_per_stage=1, share=3 / 5, forward_share=3 / 5)
    # each rank's clock onto rank 0's: the same intervals, the same share
    moved = four_ranks()
    for shifted in moved[1:]:
        shifted["events"] = [(name, kw, start + 10.0, end + 10.0) for name, kw, start, end in shifted["events"]]
        shifted["clock_offset_s"] = 10.0
    assert shared_cpus_of(moved, tp=1, dp=1, device_name="cpu").share == 3 / 5


def test_replicas_on_the_host_run_as_replica_zero():
    """dp 2 (8 ranks, the launcher says so): each running replica rank stands for two. [0, 1): 8 ranks want 2 CPUs,
    a quarter each; [1, 2): 2 ranks, a CPU each: (4 x 1 x 1/4 + 1) / (4 + 1) = 2 / 5."""
    replica = four_ranks(host_ranks=8)
    assert shared_cpus_of(replica, tp=1, dp=2, device_name="cpu") == SharedCpus(
        cpus=2, ranks=8, threads=1, ranks_per_stage=2, share=2 / 5, forward_share=3 / 5)


@pytest.mark.parametrize("why, replica, dp, device", [
    ("a GPU", four_ranks(), 1, "cuda"),
    ("CPUs enough: 4 ranks x 1 thread on 4 CPUs", four_ranks(cpus=(0, 1, 2, 3)), 1, "cpu"),
    ("two hosts", four_ranks()[:2] + four_ranks(host="other")[2:], 1, "cpu"),
    ("ranks pinned apart", four_ranks()[:2] + four_ranks(cpus=(2, 3))[2:], 1, "cpu"),
    ("other replicas, the launcher silent", four_ranks(), 2, "cpu"),
    ("a report's entries from before the CPUs were recorded", [dict(e, cpus=[]) for e in four_ranks()], 1, "cpu"),
])
def test_not_measured_where_it_cannot_be(why, replica, dp, device):
    assert shared_cpus_of(replica, tp=1, dp=dp, device_name=device) is None, why


def test_threads_count_against_the_cpus():
    """2 ranks of 2 threads on 2 CPUs share them: both compute in [0, 1), each at 2 / 4."""
    replica = [entry(0, [("ForwardPass", 0.0, 1.0)], threads=2), entry(1, [("ForwardPass", 0.0, 1.0)], threads=2)]
    assert shared_cpus_of(replica, tp=1, dp=1, device_name="cpu").share == 1 / 2
    assert shared_cpus_of([dict(e, threads=1) for e in replica], tp=1, dp=1, device_name="cpu") is None


def test_the_schedule_is_deepspeeds():
    """shared_schedule.schedule_order: each stage's forwards and backwards in DeepSpeed's TrainSchedule order."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule

    for stages, micro_batches in [(2, 8), (4, 8), (4, 3), (3, 2), (1, 4)]:
        for stage in range(stages):
            ran = [(isinstance(command, ForwardPass), command.buffer_id)
                   for step in TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage).steps()
                   for command in step if isinstance(command, (ForwardPass, BackwardPass))]
            ours = schedule_order(stage, stages, micro_batches)
            assert [forward for forward, _ in ran] == [forward for forward, _ in ours], (stages, micro_batches, stage)


def test_the_schedule_on_shared_cpus_by_hand():
    """2 stages, 2 micro-batches, a second of forward and one of backward per micro-batch on each. With a CPU each:
    F0 | F1, F0' | B0' | B0, F1' | B1' | B1 = 6 s, the pipeline model's 2 + 2 + 2. On one CPU, where two run each
    runs at half: 1 + 2 + 1 + 2 + 1 + 1 = 8 s, the host's work (never idle)."""
    assert shared_cpus_iter_s([1.0, 1.0], [1.0, 1.0], 2, cpus=2, threads_per_stage=1) == 6.0
    assert model_iter_s([4.0, 4.0], 2) == 6.0
    assert shared_cpus_iter_s([1.0, 1.0], [1.0, 1.0], 2, cpus=1, threads_per_stage=1) == 8.0
    # the measured times, less the waits (share), split as the run's compute was: the same 1 s and 1 s
    one_cpu = SharedCpus(cpus=1, ranks=2, threads=1, ranks_per_stage=1, share=0.5, forward_share=0.5)
    assert one_cpu.micro_batch_work_s([8.0, 8.0], 2) == ([1.0, 1.0], [1.0, 1.0])
    assert model_iter_s([4.0, 4.0], 2, replace_share(one_cpu, 1.0)) == 8.0


def test_a_cut_that_keeps_more_stages_busy_slows_the_others():
    """Four stages on two CPUs, the last one heavy: moving work off it onto the first three gains less than the
    pipeline model says, since three stages then run at once more often, each at two thirds of a core."""
    two_cpus = SharedCpus(cpus=2, ranks=4, threads=1, ranks_per_stage=1, share=1.0, forward_share=1 / 3)
    heavy, balanced = [1.0, 1.0, 1.0, 6.0], [2.0, 2.0, 2.0, 3.0]
    pipeline_gain = model_iter_s(balanced, 8) / model_iter_s(heavy, 8)
    shared_gain = model_iter_s(balanced, 8, two_cpus) / model_iter_s(heavy, 8, two_cpus)
    assert shared_gain > pipeline_gain
    # with every stage running all its measured time (share 1): never faster than the host's work over its CPUs,
    # nor than the pipeline with a CPU each
    for loads in (heavy, balanced):
        assert model_iter_s(loads, 8, two_cpus) >= max(sum(loads) / 2, model_iter_s(loads, 8))


def test_a_balanced_cut_gains_nothing_on_one_cpu():
    """Ran [0, 3, 4]: loads 3 and 1, m = 2: the pipeline 1.5 + 0.5 + 1.5 = 3.5; measured 6. On one CPU shared by
    the 2 ranks, running all the time, the iteration is the host's 4 s of work whatever the cut (2 s not modelled),
    so [0, 2, 4], balanced (pipeline 1 + 1 + 1 = 3), is predicted no faster: 4 + 2. The pipeline alone says
    3 + 2.5."""
    layers = [LayerCost(i, "Layer", 0 if i < 3 else 1, 1.0) for i in range(4)]
    measured = dict(current_parts=[0, 3, 4], overhead_s=[0.0, 0.0], measured_iter_s=6.0, micro_batches=2)
    one_cpu = SharedCpus(cpus=1, ranks=2, threads=1, ranks_per_stage=1, share=1.0, forward_share=0.5)
    assert predict(layers, parts=[0, 2, 4], cpus=one_cpu, **measured).predicted_iter_s == 4.0 + 2.0
    assert predict(layers, parts=[0, 2, 4], **measured).predicted_iter_s == 3.0 + 2.5
    # three ranks per stage (tensor x data parallel) on one CPU: 12 s of work for both cuts
    many = SharedCpus(cpus=1, ranks=6, threads=1, ranks_per_stage=3, share=1.0, forward_share=0.5)
    assert predict(layers, parts=[0, 2, 4], cpus=many, **measured).predicted_iter_s == 12.0 + (6.0 - 12.0)


def replace_share(shared, share):
    return dataclasses.replace(shared, share=share)


@pytest.fixture(scope="module")
def shared_report():
    """The golden fork report (pp 2 x tp 2) as if its 4 ranks had shared one CPU, running all the time."""
    report = json.loads(GOLDEN.read_text())
    report = copy.deepcopy(report)
    report["partition_plan"]["basis"]["shared_cpus"] = {"cpus": 1, "ranks": 4, "threads": 1, "ranks_per_stage": 2,
                                                        "share": 1.0}
    return report


def test_a_saved_reports_plan_and_what_if_take_the_floor(shared_report):
    run = MeasuredRun.of_report(shared_report)
    assert run.basis.shared_cpus == SharedCpus(cpus=1, ranks=4, threads=1, ranks_per_stage=2, share=1.0)
    plan = plan_of(shared_report, PlanRequest(parts=[0, 4, 7]))
    # the host's work, 2 x the stages' summed time, bounds both the partition that ran and this one
    scale = shared_report["partition_plan"]["basis"]["time_scale"]
    ran = shared_report["partition_plan"]["current_stage_s"]
    measured = shared_report["totals"]["throughput_iter_s"]
    expected = 2.0 * sum(plan["stage_s"]) + measured - 2.0 * sum(ran) * 1.0
    assert plan["predicted_iter_s"] == pytest.approx(expected, rel=1e-12) and scale > 0
    assert "4 ranks of 1 thread on 1 CPUs ran 100% of their compute time, waiting for a core the rest: predicted " \
           "as the schedule runs on those CPUs" in plan_line(plan_of(shared_report))
    what_if = recompute_what_if(shared_report, [0, 4, 7], [1, 1])
    assert what_if["predicted_iter_s"] == pytest.approx(2.0 * sum(what_if["stage_s"]) + measured - 2.0 * sum(ran),
                                                        rel=1e-12)
    assert what_if_model(shared_report).shared_cpus == dict(run.basis.shared_cpus.as_dict(), forward_share=None)
    # without it, the golden report's own plan is the pipeline model's
    assert what_if_model(json.loads(GOLDEN.read_text())).shared_cpus is None


# ---------------------------------------------------------------- CPUs that slow each other (host_contention.py)
def test_the_running_rate_by_hand():
    """Each running thread's speed: CPUs shared among the threads running as before where none slow each other;
    two CPUs each at 0.6 of their speed alone once both are busy; four CPUs at 0.6 once all four are, 0.8 at three
    of four (two thirds of the way)."""
    for threads in range(1, 6):
        for cpus in (1, 2, 4):
            assert running_rate(threads, cpus) == min(1.0, cpus / threads)
    assert [running_rate(threads, 2, 0.6, 2) for threads in (1, 2, 4)] == [1.0, 0.6, 0.3]
    assert running_rate(3, 4, 0.6, 4) == pytest.approx(0.6 + 0.4 / 3, rel=1e-15)
    assert running_rate(3, 4, 0.6, 3) == pytest.approx(0.6, rel=1e-15)  # the job keeps three busy at most


def test_the_schedule_on_cpus_that_slow_each_other_by_hand():
    """The schedule of test_the_schedule_on_shared_cpus_by_hand on two CPUs that run at half speed both busy: F0
    alone 1 | F1, F0' at half 2 | B0' alone 1 | B0, F1' at half 2 | B1' 1 | B1 1 = 8 s; with CPUs that do not
    slow each other, 6 s."""
    assert shared_cpus_iter_s([1.0, 1.0], [1.0, 1.0], 2, cpus=2, threads_per_stage=1, together_rate=0.5,
                              together_threads=2) == 8.0
    assert shared_cpus_iter_s([1.0, 1.0], [1.0, 1.0], 2, 2, 1, together_rate=1.0, together_threads=2) == 6.0
    slowed = SharedCpus(cpus=2, ranks=2, threads=1, ranks_per_stage=1, share=0.75, forward_share=0.5,
                        together_rate=0.5, stage_shares=[0.75, 0.75])
    assert slowed.together_threads == 2
    # the stage shares are taken out of each layer where it is read, not again here
    assert slowed.micro_batch_work_s([4.0, 4.0], 2) == ([1.0, 1.0], [1.0, 1.0])
    assert model_iter_s([4.0, 4.0], 2, slowed) == 8.0


def two_ranks_slowed(rate=0.5):
    """Two ranks of one thread on two CPUs, measured running at `rate` together: rank 0 computes in [0, 2), rank 1
    in [1, 4)."""
    return [dict(entry(0, [("ForwardPass", 0.0, 2.0)]), together_rate=rate),
            dict(entry(1, [("ForwardPass", 1.0, 2.5), ("BackwardPass", 2.5, 4.0)]), together_rate=rate)]


def test_the_stage_shares_by_hand():
    """[0, 1) rank 0 alone at full speed, [1, 2) both at half, [2, 4) rank 1 alone: rank 0 did 1.5 s of work in 2,
    rank 1 2.5 in 3; together 4 of 5. The forward instructions: 3.5 of the 5 s."""
    assert shared_cpus_of(two_ranks_slowed(), tp=1, dp=1, device_name="cpu") == SharedCpus(
        cpus=2, ranks=2, threads=1, ranks_per_stage=1, share=4 / 5, forward_share=3.5 / 5, together_rate=0.5,
        stage_shares=[3 / 4, 2.5 / 3])
    # CPUs enough that did not slow each other, or a rate not measured: no term, as before
    assert shared_cpus_of(two_ranks_slowed(1.0), tp=1, dp=1, device_name="cpu") is None
    assert shared_cpus_of([dict(e, together_rate=None) for e in two_ranks_slowed()], tp=1, dp=1,
                          device_name="cpu") is None


def test_a_saved_reports_plan_takes_each_stage_at_full_speed(shared_report):
    """The golden report as if its 4 ranks, on 4 CPUs, had run at half speed all computing, stage 0 at 0.6 of full
    speed over its compute time and stage 1 at 0.9: each layer and overhead is taken at its stage's share, the
    partition that ran is predicted as measured, and a cut is predicted on the slowed schedule, in the page too."""
    slowed = copy.deepcopy(shared_report)
    slowed["partition_plan"]["basis"]["shared_cpus"] = {
        "cpus": 4, "ranks": 4, "threads": 1, "ranks_per_stage": 2, "share": 0.8, "forward_share": 1 / 3,
        "together_rate": 0.5, "stage_shares": [0.6, 0.9]}
    run = MeasuredRun.of_report(slowed)
    scale = run.time_scale
    assert [run.stage_scale(stage) for stage in (0, 1)] == [scale * 0.6, scale * 0.9]
    ran_parts = slowed["partition_plan"]["current_parts"]
    ran = plan_of(slowed, PlanRequest(parts=ran_parts))
    assert ran["stage_s"] == pytest.approx(run.ran_stage_s, rel=1e-12)
    assert ran["predicted_iter_s"] == pytest.approx(slowed["totals"]["throughput_iter_s"], rel=1e-12)
    # the first stage's layers are cheaper than measured (it ran slowed most): a cut moving work onto it costs less
    # than with one share for both
    one_share = copy.deepcopy(slowed)
    one_share["partition_plan"]["basis"]["shared_cpus"]["stage_shares"] = [0.8, 0.8]
    assert plan_of(slowed, PlanRequest(parts=[0, 5, 7]))["predicted_iter_s"] < \
        plan_of(one_share, PlanRequest(parts=[0, 5, 7]))["predicted_iter_s"]
    assert "4 ranks of 1 thread on 4 CPUs did 80% of their compute time's work at full speed: each ran 0.50x its " \
           "speed alone while all computed (measured)" in what_if_line(plan_of(slowed, PlanRequest(parts=[0, 5, 7])))
