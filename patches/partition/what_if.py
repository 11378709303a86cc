"""The planner's model of one measured run as plain numbers, for a what-if outside Python (the profile page's): every
term megatron-plan-partition's `--parts` and `--recompute` predictions read, already scaled, so that another
partition's (and each stage's recompute's) time and peaks are a few sums and the two formulas below.

    stage_s[s]   = its layers' seconds + its position's overhead (+ each recomputed layer's recompute_s)
    iteration    = model(stage_s) + measured_iter_s - model(the stages as they ran)
    model(t)     = sum(t / m) + (m - 1) * max(t / m)                                          (planner.model_iter_s)
                   where the ranks shared too few CPUs, 1F1B on the CPUs they share      (shared_schedule.py)
    peak[s]      = memory_model.stage_peak(its layers' state, their activations, its position[, recompute transient],
                                           its layers' largest parameter)

Without recompute terms, a layer costs `seconds` and keeps `activation_bytes` (as it ran: planner.predict and
report_plan.peak_of); with them, it costs `base_s` plus `recompute_s` where recomputed, and keeps `whole_bytes`, or
`checkpoint_bytes` where recomputed, the largest recomputed layer's whole bytes alive while its backward runs
(recompute_plan.StageOptions.choice). Sums over a stage's layers are taken in the planner's order (a direct sum,
or prefix sums where recompute_plan takes them), so that another language gets the same floating-point figures.
Only the number of stages that ran: another one moves each position's terms (memory_model.positions_for), which
the page does not offer. No torch or DeepSpeed import.
"""
from dataclasses import asdict, dataclass
from typing import List, Optional

from patches.partition.measured_run import MeasuredRun
from patches.partition.memory_model import PositionMemory
from patches.partition.plan_lines import shared_cpus_sentence
from patches.partition.report_recompute import recompute_options
from patches.partition.table import layer_seconds


@dataclass(frozen=True)
class WhatIfLayer:
    index: int
    type: str
    seconds: float  # as it ran (forward + backward + recompute), scaled to the steady iteration
    state_bytes: Optional[int]  # None: no memory terms
    activation_bytes: Optional[int]  # as it ran, per micro-batch
    base_s: Optional[float] = None  # forward + backward, without recompute; None: no recompute terms
    recompute_s: Optional[float] = None
    recomputable: Optional[bool] = None
    whole_bytes: Optional[int] = None
    checkpoint_bytes: Optional[int] = None
    largest_param_bytes: int = 0  # the step floor's (memory_model)
    recomputed: bool = False  # it recomputed in the run: a recompute of it is priced as measured, not at its forward


@dataclass(frozen=True)
class WhatIfModel:
    micro_batches: int
    measured_iter_s: float
    ran_model_s: float  # the model of the partition that ran: what the model leaves out is measured minus it
    current_parts: List[int]
    overhead_s: List[float]  # each stage position's, scaled
    layers: List[WhatIfLayer]
    positions: Optional[List[PositionMemory]]  # None: no memory terms
    recompute_terms: bool  # each layer has base_s .. checkpoint_bytes
    memory_limit_bytes: Optional[int]
    shared_cpus: Optional[dict] = None  # SharedCpus.as_dict(); None where the ranks had CPUs enough
    shared_cpus_words: Optional[str] = None  # in the plan line's words (plan_lines.shared_cpus_sentence)

    def as_dict(self) -> dict:
        return asdict(self)


def what_if_model(report: dict) -> Optional[WhatIfModel]:
    """The model of a report with a layer table and a partition plan (a PipelineModule's run over several stages);
    None otherwise."""
    plan, rows = report.get("partition_plan"), report.get("layers")
    if not plan or not rows:
        return None
    run = MeasuredRun.of_report(report)
    overheads = run.scaled_overheads
    rows = sorted(rows, key=lambda row: row["index"])
    options = recompute_options(run, len(run.parts) - 1)
    memory_rows = {layer.index: layer for layer in run.memory[0]} if run.memory is not None else {}
    layers = []
    for position, row in enumerate(rows):
        kept = memory_rows.get(row["index"])
        both = options.layers[position] if options is not None else None
        layers.append(WhatIfLayer(
            row["index"], row["type"], layer_seconds(row) * run.stage_scale(row["stage"]),
            kept.state_bytes if kept else None,
            kept.activation_bytes if kept else None, both.seconds if both else None,
            both.recompute_s if both else None, both.recomputable if both else None,
            both.whole_bytes if both else None, both.checkpoint_bytes if both else None,
            kept.largest_param_bytes if kept else 0, bool(row["recompute_flops"])))
    cpus = run.shared_cpus
    return WhatIfModel(run.micro_batches, run.iter_s, run.ran_model_iter_s,
                       list(run.parts), overheads, layers,
                       _positions(run, options), options is not None,
                       plan.get("memory_limit_bytes"), cpus.as_dict() if cpus is not None else None,
                       shared_cpus_sentence(cpus.as_dict()) if cpus is not None else None)


def _positions(run: MeasuredRun, options) -> Optional[List[PositionMemory]]:
    """Each position's memory terms; with recompute terms, as the recompute choices read them (each told the largest
    layer the run recomputed there), which the plain prediction reads alike (it recomputes nothing new)."""
    if options is not None:
        return list(options.positions)
    return list(run.memory[1]) if run.memory is not None else None
