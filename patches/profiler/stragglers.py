"""The straggler view: per stage, how each timing spreads over the data-parallel replicas.

Every rank sends rank 0 one fixed-size RankSample (a few seconds and its coordinates, or why it
failed), so rank 0 holds O(world) scalars and no other rank receives any of them.
"""
import statistics
import struct
from dataclasses import dataclass
from typing import List, Optional

from patches.profiler.instructions import BACKWARD_INSTRUCTIONS, COMM_INSTRUCTIONS, FORWARD_INSTRUCTIONS

# (sample field, printed label): the timings compared over replicas.
METRICS = (("train_batch_s", "train_batch"), ("fwd_s", "fwd"), ("bwd_s", "bwd"), ("comm_s", "comm+wait"))

# 4 coordinates, 4 timings (float64), then the failure text (UTF-8, zero padded).
_NUMBERS = struct.Struct("<4q4d")
SAMPLE_BYTES = 256
FAILURE_BYTES = SAMPLE_BYTES - _NUMBERS.size


def error_summary(error: BaseException) -> str:
    """'ErrorType: first line of the message', at most 200 characters: how a failed rank is named."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}"[:200]


@dataclass(frozen=True)
class RankSample:
    global_rank: int
    stage_id: int
    tp_rank: int
    dp_rank: int
    train_batch_s: float
    fwd_s: float
    bwd_s: float
    comm_s: float
    failure: Optional[str] = None  # "ErrorType: message" when this rank could not build its entry

    @classmethod
    def from_entry(cls, entry: dict) -> "RankSample":
        """The scalars of one rank's entry dict (as build_report reads it)."""
        instructions = entry["instructions"]

        def total(names):
            return float(sum(instructions[name]["total_s"] for name in names if name in instructions))
        return cls(int(entry["global_rank"]), int(entry["stage_id"]), int(entry["tp_rank"]), int(entry["dp_rank"]),
                   float(entry["train_batch_latency_s"]), total(FORWARD_INSTRUCTIONS), total(BACKWARD_INSTRUCTIONS),
                   total(COMM_INSTRUCTIONS))

    @classmethod
    def failed(cls, global_rank: int, stage_id: int, tp_rank: int, dp_rank: int,
               error: BaseException) -> "RankSample":
        """A rank that could not build its entry: no timings, and why (error_summary)."""
        nan = float("nan")
        return cls(global_rank, stage_id, tp_rank, dp_rank, nan, nan, nan, nan, failure=error_summary(error))

    def to_bytes(self) -> bytes:
        numbers = _NUMBERS.pack(self.global_rank, self.stage_id, self.tp_rank, self.dp_rank,
                                self.train_batch_s, self.fwd_s, self.bwd_s, self.comm_s)
        text = (self.failure or "").encode("utf-8")[:FAILURE_BYTES]
        return numbers + text.ljust(FAILURE_BYTES, b"\0")

    @classmethod
    def from_bytes(cls, raw: bytes) -> "RankSample":
        values = _NUMBERS.unpack(raw[:_NUMBERS.size])
        text = raw[_NUMBERS.size:].rstrip(b"\0").decode("utf-8", errors="replace")
        return cls(*values, failure=text or None)


def straggler_view(samples: List[RankSample], pp: int, dp: int) -> dict:
    """{'stages': [per stage: replicas, and per timing min / median / max over the replicas and the
    slowest replica (its dp rank and global ranks)]}.

    A replica's time on a stage is its slowest tensor rank's (the stage waits for it)."""
    # One pass over the samples: {(stage, dp rank): its samples}, so the view is linear in the world.
    by_replica = {}
    for sample in samples:
        by_replica.setdefault((sample.stage_id, sample.dp_rank), []).append(sample)
    stages = []
    for stage_id in range(pp):
        replicas = [by_replica[(stage_id, d)] for d in range(dp)]
        row = {"stage_id": stage_id, "replicas": dp}
        for field, _ in METRICS:
            per_replica = [max(getattr(s, field) for s in replica) for replica in replicas]
            slowest = max(range(dp), key=lambda d: (per_replica[d], -d))
            row[field] = {"min": min(per_replica), "median": float(statistics.median(per_replica)),
                          "max": max(per_replica), "slowest_dp_rank": slowest,
                          "slowest_ranks": sorted(s.global_rank for s in replicas[slowest])}
        stages.append(row)
    return {"stages": stages}
