"""One rank's record of the profiled iteration: what it measured (StageMeasurement.entry), as the report builder and
the trace read it."""
from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class RankEntry:
    """One rank's measurements, as build_report and build_trace read them (as_dict)."""
    global_rank: int
    stage_id: int
    tp_rank: int
    dp_rank: int
    modules: dict
    instructions: dict
    train_batch_latency_s: float
    peak_memory_bytes: Optional[int]
    events: list
    uncounted_ops: list = field(default_factory=list)  # ModuleProfiler.uncounted_ops() as dicts
    counted_iteration: Optional[int] = None  # where the FLOPs were counted when not in the profiled iteration
    calls_differ: list = field(default_factory=list)  # ModuleProfiler.adopt_counts(): calls unlike the counted ones
    schedule: Optional[str] = None  # the pipeline schedule's class (EngineHooks.schedule); None on a plain engine
    invisible_attention: list = field(default_factory=list)  # ModuleProfiler.invisible_attention()
    layers: Optional[list] = None  # layers.stage_layers(): this stage's layers of a PipelineModule, else None
    parts: Optional[list] = None  # the PipelineModule's stage boundaries (PipelineModule.parts)
    memory: Optional[dict] = None  # memory.StageMemory.as_dict(), measured where the FLOPs were counted
    # gc_pauses.GcSummary.as_dict() of the profiled iteration, with in_compute_s: its pauses inside the forward
    # and backward instructions (left out of every module's latency, not out of the instructions')
    gc: Optional[dict] = None
    faults: list = field(default_factory=list)  # fail_safe.MeasurementFault.as_dict(): parts not measured, and why
    clock_offset_s: float = 0.0
    clock_error_s: float = 0.0
    # where the rank ran (shared_cpus.py): its host, the CPUs it may run on, torch's threads, and the job's ranks on
    # its host as its launcher counted them (None: not told)
    host: Optional[str] = None
    cpus: list = field(default_factory=list)
    threads: int = 1
    host_ranks: Optional[int] = None
    # its speed with every rank computing over its speed alone (host_contention.py); None: not measured
    together_rate: Optional[float] = None

    def as_dict(self) -> dict:
        return asdict(self)
