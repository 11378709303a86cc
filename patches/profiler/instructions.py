"""The pipeline schedules' vocabulary: DeepSpeed's instructions grouped by the work they do, and the ideal bubble
of the schedules the profiler knows.

DeepSpeed's 1F1B TrainSchedule runs ForwardPass and BackwardPass. Upstream Megatron-DeepSpeed's zero-bubble
schedule (--enable-zbh1-pipeline: ZeroBubbleH1Pipeline, which it puts in DeepSpeed's TrainSchedule's place)
splits the backward into BackwardOnlyPass (the input gradients, in autograd) and WeightPass (the weight
gradients it deferred, run outside autograd). Any other instruction a schedule adds is timed and named as it is.
"""
from dataclasses import dataclass
from typing import Callable, Optional

# In the order a 1F1B step meets them (others after these, by name).
INSTRUCTION_ORDER = ("LoadMicroBatch", "RecvActivation", "ForwardPass", "SendActivation", "RecvGrad", "BackwardPass",
                     "BackwardOnlyPass", "WeightPass", "SendGrad", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep")
FORWARD_INSTRUCTIONS = ("ForwardPass",)
BACKWARD_INSTRUCTIONS = ("BackwardPass", "BackwardOnlyPass", "WeightPass")
COMM_INSTRUCTIONS = ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad")
REDUCE_INSTRUCTIONS = ("ReduceGrads", "ReduceTiedGrads")
# Backward work that a schedule runs outside autograd: its ops count as backward (EngineHooks).
BACKWARD_OUTSIDE_AUTOGRAD = frozenset(("WeightPass",))


@dataclass(frozen=True)
class ScheduleBubble:
    """A schedule's ideal idle fraction: what the bubble analysis compares each stage with."""
    name: str  # as the report names the schedule
    formula: str
    fraction: Callable[[int, int], float]  # (pp, micro-batches) -> ideal idle fraction


ONE_F_ONE_B = ScheduleBubble("1F1B", "(pp - 1) / (micro-batches + pp - 1)", lambda pp, m: (pp - 1) / (m + pp - 1))
# Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024): ZB-H1's bubble is (pp - 1)(F + B - W) against 1F1B's
# (pp - 1)(F + B + W); with forward, input-gradient and weight-gradient times equal, a third of it.
ZB_H1 = ScheduleBubble("ZB-H1", "(pp - 1) / (3 * micro-batches + pp - 1), with F = B = W",
                       lambda pp, m: (pp - 1) / (3 * m + pp - 1))
KNOWN_SCHEDULES = {"TrainSchedule": ONE_F_ONE_B, "ZeroBubbleH1Pipeline": ZB_H1}


def schedule_bubble(schedule: Optional[str]) -> Optional[ScheduleBubble]:
    """The ideal of the schedule class `schedule` (None: a plain engine's, DeepSpeed's 1F1B order), or None where
    the profiler does not know it."""
    return ONE_F_ONE_B if schedule is None else KNOWN_SCHEDULES.get(schedule)
