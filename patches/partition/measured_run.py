"""What one profiled run measured, as every plan reads it: its layer table, the partition that ran, each stage's
overhead, its steady iteration and what that rests on (Basis), its memory terms and its schedule. Read once from
a report (MeasuredRun.of_report); the plan (report_plan.py), the recompute plan (report_recompute.py) and the page's
model (what_if.py) take it whole."""
from dataclasses import dataclass
from typing import List, Optional, Tuple

from patches.partition.memory_model import memory_terms_of
from patches.partition.planner import SharedCpus, model_iter_s
from patches.partition.table import layer_seconds, parts_from_layers


@dataclass(frozen=True)
class Basis:
    """What a plan's times rest on: the steady iteration they are scaled to, and how steady it was."""
    time_scale: float = 1.0  # the measured layer times x this: unprofiled / profiled iteration, on one clock
    iterations: Tuple[int, ...] = ()  # the unprofiled iterations the iteration time is the median of
    spread: Optional[float] = None  # (slowest - fastest) / median of those
    note: Optional[str] = None  # why the basis is weak (a warm-up baseline, none), or None
    # where the run's ranks shared too few CPUs: the stages' share of their time running, with which every
    # prediction runs the schedule on the CPUs they share (planner.model_iter_s); None elsewhere
    shared_cpus: Optional[SharedCpus] = None

    def as_dict(self) -> dict:
        return {"time_scale": self.time_scale, "iterations": list(self.iterations), "spread": self.spread,
                "note": self.note,
                "shared_cpus": self.shared_cpus.as_dict() if self.shared_cpus is not None else None}

    @classmethod
    def of_dict(cls, stored: Optional[dict]) -> Optional["Basis"]:
        """From a report's plan (None there: a report from before plans had one)."""
        if not stored:
            return None
        return cls(stored["time_scale"], tuple(stored["iterations"]), stored["spread"], stored["note"],
                   SharedCpus.of_dict(stored.get("shared_cpus")))


@dataclass(frozen=True)
class MeasuredRun:
    """What one profiled run measured, as the planner reads it."""
    layers: List[dict]  # the report's layer table
    parts: List[int]  # the partition that ran
    overheads: List[float]  # each stage's work that no layer accounts for, as measured
    iter_s: float  # the steady iteration every plan's times are scaled to
    micro_batches: int
    basis: Optional[Basis] = None
    memory: Optional[tuple] = None  # memory_model.memory_terms_of's (layers, positions); None: not measured
    schedule: Optional[str] = None  # the run's, for the in-flight micro-batches of another number of stages

    @property
    def time_scale(self) -> float:
        """Every measured time x this is on the steady iteration's clock (Basis.time_scale); stage_scale for a
        stage's."""
        return self.basis.time_scale if self.basis is not None else 1.0

    def stage_scale(self, stage: int) -> float:
        """What the seconds measured on `stage` are multiplied by: time_scale, and where the ranks shared their CPUs
        stage by stage (SharedCpus.stage_shares), the share of the stage's compute time it ran at full speed, so
        that its layers and overhead are their work at full speed wherever the plan puts them."""
        cpus = self.shared_cpus
        if cpus is None or cpus.stage_shares is None:
            return self.time_scale
        return self.time_scale * cpus.stage_shares[stage]

    @property
    def scaled_overheads(self) -> List[float]:
        return [overhead * self.stage_scale(stage) for stage, overhead in enumerate(self.overheads)]

    @property
    def ran_stage_s(self) -> List[float]:
        """Each stage's load as it ran: its layers' measured seconds and its overhead, scaled."""
        overheads = self.scaled_overheads
        return [sum(layer_seconds(row) * self.stage_scale(s) for row in self.layers if row["stage"] == s)
                + overheads[s] for s in range(len(self.parts) - 1)]

    @property
    def ran_model_iter_s(self) -> float:
        """The model's iteration for the partition as it ran; the measured iteration minus this is what the model
        leaves out, which every prediction from this run adds back."""
        return model_iter_s(self.ran_stage_s, self.micro_batches, self.shared_cpus)

    @property
    def shared_cpus(self) -> Optional[SharedCpus]:
        """Where its ranks shared too few CPUs: every prediction from it runs the schedule on them (model_iter_s)."""
        return self.basis.shared_cpus if self.basis is not None else None

    @classmethod
    def of_report(cls, report: dict) -> "MeasuredRun":
        plan = report.get("partition_plan") or {}
        parts = plan.get("current_parts") or parts_from_layers(report["layers"])
        return cls(report["layers"], parts, plan.get("stage_overhead_s") or [0.0] * (len(parts) - 1),
                   report["totals"]["throughput_iter_s"], report["parallelism"]["micro_batches"],
                   Basis.of_dict(plan.get("basis")), memory_terms_of(report),
                   (report.get("bubble") or {}).get("schedule"))
