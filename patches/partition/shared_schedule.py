"""DeepSpeed's 1F1B schedule run on CPUs its stages share: how long an iteration takes when the ranks that have work
at a moment split the host's CPUs between them (processor sharing).

With CPUs enough, one micro-batch passes through every stage and the other m - 1 follow at the slowest stage's pace
(planner.model_iter_s). Four ranks of one thread on two CPUs cannot all run at once: while three have work each
runs at two thirds of a core, so a cut that gives the light stages more work slows the heavy one too, and no cut
does the host's work faster than its CPUs can. Here every stage runs its instructions in DeepSpeed's TrainSchedule
order (warm-up forwards, one forward and one backward in turn, the last backwards), a forward waits for the stage
before it, a backward for the stage after it, and at every moment each rank with an instruction it can run
progresses at min(1, CPUs / threads of the ranks running); the iteration ends with the last instruction. CPUs that
slow each other when busy at once (two threads of one core, a virtual machine's: profiler/host_contention.py) give
each busy one `together_rate` of its speed alone once all of them the job can keep busy are (running_rate), in
between in proportion. The same arithmetic, in the same order, runs in the profile page (what_if.js), so both give
the same figures.
"""
from typing import List, Optional, Sequence, Tuple


def schedule_order(stage: int, stages: int, micro_batches: int) -> List[Tuple[bool, int]]:
    """Stage `stage`'s instructions as DeepSpeed's TrainSchedule runs them: (is_forward, micro-batch)."""
    warm_up = min(stages - stage - 1, micro_batches)
    order = [(True, i) for i in range(warm_up)]
    for i in range(micro_batches - warm_up):
        order += [(True, warm_up + i), (False, i)]
    return order + [(False, i) for i in range(micro_batches - warm_up, micro_batches)]


def running_rate(threads: int, cpus: int, together_rate: float = 1.0, together_threads: int = 1) -> float:
    """Each of `threads` running threads' speed, relative to one alone on a CPU: the busy CPUs, min(threads, cpus),
    shared among them, each CPU at together_rate of its speed once together_threads of them are busy (the most the
    job keeps busy), at full speed when one is, in proportion between."""
    busy = min(threads, cpus)
    crowding = min(1.0, (busy - 1) / (together_threads - 1)) if together_threads > 1 else 0.0
    return busy * (1.0 - (1.0 - together_rate) * crowding) / threads


def shared_cpus_iter_s(forward_s: Sequence[float], backward_s: Sequence[float], micro_batches: int, cpus: int,
                       threads_per_stage: int, together_rate: float = 1.0, together_threads: int = 1) -> float:
    """The iteration's seconds: forward_s[s] and backward_s[s] are stage s's work for one micro-batch at a whole
    core per thread; threads_per_stage: the threads one stage's running ranks ask for (tensor x data parallel ranks
    x torch's threads); together_rate and together_threads: running_rate's."""
    stages = len(forward_s)
    orders = [schedule_order(stage, stages, micro_batches) for stage in range(stages)]
    next_step = [0] * stages
    forwards_done, backwards_done = [0] * stages, [0] * stages
    work_left: List[Optional[float]] = [None] * stages  # of the instruction each stage has begun
    now = 0.0
    while any(next_step[stage] < len(orders[stage]) for stage in range(stages)):
        running = []
        for stage in range(stages):
            if next_step[stage] == len(orders[stage]):
                continue
            is_forward, micro_batch = orders[stage][next_step[stage]]
            if is_forward:
                ready = stage == 0 or forwards_done[stage - 1] > micro_batch
            else:
                ready = stage == stages - 1 or backwards_done[stage + 1] > micro_batch
            if ready:
                if work_left[stage] is None:
                    work_left[stage] = forward_s[stage] if is_forward else backward_s[stage]
                running.append(stage)
        rate = running_rate(len(running) * threads_per_stage, cpus, together_rate, together_threads)
        step = min(work_left[stage] / rate for stage in running)
        now += step
        for stage in running:
            if work_left[stage] / rate <= step:  # the first to end (the same expression step is the least of)
                is_forward, _ = orders[stage][next_step[stage]]
                if is_forward:
                    forwards_done[stage] += 1
                else:
                    backwards_done[stage] += 1
                next_step[stage] += 1
                work_left[stage] = None
            else:
                work_left[stage] -= step * rate
    return now
