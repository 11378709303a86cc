"""DeepSpeed's 1F1B TrainSchedule run on ideal simulated hardware, as the rank entries a profiled
step would gather: the report's bubble analysis and trace can then be checked against exact times."""
from collections import defaultdict

from deepspeed.runtime.pipe.schedule import TrainSchedule

from tests.helpers.contexts import report_context

TF, TB = 0.25, 0.5  # ideal forward and backward times per micro-batch: exact binary fractions


def simulate_1f1b(stages, micro_batches):
    """Per stage, the (instruction, kwargs, start, end) events of DeepSpeed's TrainSchedule when forward
    takes TF, backward TB and every other instruction no time; a receive ends when its send has."""
    commands = [[c for step in TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=s).steps()
                 for c in step] for s in range(stages)]
    position, clock = [0] * stages, [0.0] * stages
    events, seen, sent = [[] for _ in range(stages)], [defaultdict(int) for _ in range(stages)], {}
    receiver = {"SendActivation": (1, "RecvActivation"), "SendGrad": (-1, "RecvGrad")}
    while any(position[s] < len(commands[s]) for s in range(stages)):
        for s in range(stages):
            while position[s] < len(commands[s]):
                command = commands[s][position[s]]
                name = type(command).__name__
                k = seen[s][name]
                start = clock[s]
                if name in ("RecvActivation", "RecvGrad"):
                    if (s, name, k) not in sent:
                        break
                    end = max(start, sent[(s, name, k)])
                else:
                    end = start + {"ForwardPass": TF, "BackwardPass": TB}.get(name, 0.0)
                if name in receiver:
                    step, recv = receiver[name]
                    sent[(s + step, recv, k)] = end
                seen[s][name] += 1
                events[s].append((name, dict(command.kwargs), start, end))
                clock[s], position[s] = end, position[s] + 1
    return events


def schedule_entries(stages, micro_batches, tp=1, shifts=None):
    """Gathered rank entries of the simulated schedule; rank r's clock runs shifts[r] seconds ahead."""
    shifts = shifts or {}
    entries = []
    for stage_id, events in enumerate(simulate_1f1b(stages, micro_batches)):
        for tp_rank in range(tp):
            rank = stage_id * tp + tp_rank
            shift = shifts.get(rank, 0.0)
            totals = defaultdict(lambda: {"count": 0, "total_s": 0.0})
            for name, _, start, end in events:
                totals[name]["count"] += 1
                totals[name]["total_s"] += end - start
            entries.append({
                "global_rank": rank, "stage_id": stage_id, "tp_rank": tp_rank, "dp_rank": 0,
                "modules": {"name": "Stage", "type": "Stage", "params": 10, "children": []},
                "instructions": dict(totals), "peak_memory_bytes": None,
                "train_batch_latency_s": events[-1][3] - events[0][2],
                "events": [(name, kwargs, start + shift, end + shift) for name, kwargs, start, end in events],
                "clock_offset_s": shift, "clock_error_s": 2.0 ** -20,
            })
    return entries


def schedule_context(stages, micro_batches, tp=1, seq_length=4):
    return report_context(3, stages, tp, 1, micro_batches, 1, seq_length=seq_length)
