"""What DeepSpeed's `PipelineModule(partition_method='profile')` cuts (the patch that makes it do so, which
DeepSpeed raises NotImplementedError for in every release, is patches/to_deepspeed/partition_method.py): where a
measured run says.

    PipelineModule(layers, num_stages=2, partition_method="profile:profiles/flops_profile_step3.json")
    PipelineModule(layers, num_stages=2, partition_method="profile")   # the report in $DS_PIPE_PARTITION_PROFILE
    DS_PIPE_PARTITION_MEMORY_LIMIT=70GiB                                # each stage's predicted peak within it

The report is the profiler's JSON (flops_profile_stepN.json) of a run of the same layers: its per-layer table
gives each layer's measured forward, backward and recompute seconds, and the planner (planner.py, report_plan.py)
cuts them into this module's num_stages, contiguous, no stage empty, the slowest stage as fast as it can be;
num_stages may differ from the profiled run's. One line on global rank 0 names the parts used. A report of
another model (another number of layers, or other layer types) is refused with PatchConfigError, one line.
Megatron runs name the report with --pp-partition-from-profile (megatron_flags.py), which cuts every
PipelineModule of the run this way whatever partition_method its code passes (RunSettings.partition_report).
Under a memory limit (memory_limit: --pp-partition-memory-limit, else $DS_PIPE_PARTITION_MEMORY_LIMIT, else the
accelerator's memory; none on CPU) the plan is the fastest whose every stage's predicted peak is within it; where
none is, global rank 0 warns in one line by how much the closest exceeds, and the run goes on with it.
Other methods are DeepSpeed's own, unchanged. Every rank reads the report and plans; the ranks then compare what
they planned through the default group's store (agreed_parts), so that a report missing on one node, or
another report on another, stops every rank in one line.
"""
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch.distributed as dist
from deepspeed.runtime.pipe.module import PipelineModule

from patches.formats.units import parse_size
from patches.partition.layers import layer_types
from patches.partition.plan_lines import no_fit_line
from patches.partition.recompute import recompute_layers
from patches.partition.report_file import read_report
from patches.partition.report_plan import PlanRequest, plan_of
from patches.process import store
from patches.process.errors import PatchConfigError
from patches.process.registry import REGISTRY

METHOD = "profile"
ENVIRONMENT = "DS_PIPE_PARTITION_PROFILE"
MEMORY_ENVIRONMENT = "DS_PIPE_PARTITION_MEMORY_LIMIT"



@dataclass(frozen=True)
class Cut:
    """What a PipelineModule cut by a profile's plan runs."""
    parts: List[int]
    recompute_layers: Optional[Tuple[int, ...]] = None  # the plan's recompute per stage; None: as the module asks

    def words(self) -> str:
        if self.recompute_layers is None:
            return ""
        return (f", each stage recomputing its first {','.join(map(str, self.recompute_layers))} recomputable "
                "layers (chosen with the parts, within the memory limit)")


def cut_by(plan: dict) -> Cut:
    """Under a memory limit asked for (the flag or the environment; not the device's memory, a default the
    prediction would be taken right up to), the partition with each stage's recompute chosen with it (the plan's
    recompute_plan), where the report allowed one, it fits, and no recompute per stage is asked for otherwise
    (--pp-recompute-layers, $DS_PIPE_RECOMPUTE_LAYERS); else the plan's parts, the recompute as the module asks."""
    chosen = plan.get("recompute_plan")
    asked = plan.get("memory_limit_source") in ("flag", "environment")
    if chosen is None or not asked or not chosen["memory_fits"] or recompute_layers()[0] is not None:
        return Cut(list(plan["parts"]))
    return Cut(list(chosen["parts"]), tuple(chosen["recompute_layers"]))


def parts_for(module: PipelineModule, method) -> Optional[Cut]:
    """Where `module` is cut, and what each stage recomputes, where its partition_method names a profile report,
    or --pp-partition-from-profile names one for every pipeline: planned from the report under the memory limit
    (cut_by), agreed by every rank (agreed_parts), said in one line on global rank 0. None: the method is
    DeepSpeed's own."""
    report = REGISTRY.settings.partition_report  # --pp-partition-from-profile
    if report is None and not names_a_profile(method):  # the same answer on every rank
        return None
    plan, cut = None, None
    try:
        report = report or report_named_by(method)
        plan = profiled_plan(report, layer_types(module), module.num_stages, *memory_limit())
        cut, error = cut_by(plan), None
    except PatchConfigError as problem:
        error = str(problem)
    parts = agreed_parts(report, cut.parts if cut is not None else None, error)  # the same plan on every rank
    if module.global_rank == 0:
        print(f"> partition_method 'profile' ({report}): parts {parts}, planned from its measured layers"
              f"{cut.words()}", flush=True)
        if plan["memory_fits"] is False and cut.recompute_layers is None:
            print(f"warning: partition_method 'profile' ({report}): {no_fit_line(plan)}; training goes on with "
                  "them", flush=True)
    return cut


def memory_limit() -> Tuple[Optional[int], Optional[str]]:
    """(bytes, source): the per-stage memory limit plans are made under and where it came from: 'flag'
    (--pp-partition-memory-limit), 'environment' ($DS_PIPE_PARTITION_MEMORY_LIMIT), 'device' (the accelerator's
    total memory, where it reports one), or (None, None) (CPU: none). A bad $DS_PIPE_PARTITION_MEMORY_LIMIT is a
    PatchConfigError, one line."""
    if REGISTRY.settings.partition_memory_limit is not None:
        return REGISTRY.settings.partition_memory_limit, "flag"
    text = os.environ.get(MEMORY_ENVIRONMENT)
    if text:
        try:
            return parse_size(text), "environment"
        except ValueError as error:
            raise PatchConfigError(f"${MEMORY_ENVIRONMENT}: {error}") from None
    total = device_memory()
    return (total, "device") if total is not None else (None, None)


def device_memory() -> Optional[int]:
    """This process's accelerator's total memory in bytes; None on CPU or where the accelerator does not say."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return None
    try:
        if accelerator.device_name() == "cuda":
            import torch

            return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        return int(accelerator.total_memory(accelerator.current_device()))
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


def names_a_profile(method) -> bool:
    return isinstance(method, str) and method.split(":", 1)[0].lower() == METHOD


def agreed_parts(report: Optional[str], parts: Optional[List[int]], error: Optional[str]) -> List[int]:
    """The parts every rank planned, once all have: each rank publishes its parts (or its error) under its own key
    of the default group's store and reads every other rank's, so a report unreadable on some nodes stops every
    rank in the same line instead of leaving the others in DeepSpeed's next collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise PatchConfigError(error)
        return parts
    REGISTRY.pipeline_modules_built += 1  # every rank builds its PipelineModules in the same order
    world = dist.get_world_size()
    results = store.every_ranks(f"partition_profile/module{REGISTRY.pipeline_modules_built}", (parts, error))
    failed = [other for other, (_, other_error) in enumerate(results) if other_error is not None]
    if failed:
        first = results[failed[0]][1]
        if len(failed) == world and all(results[other][1] == first for other in failed):
            raise PatchConfigError(first)
        raise PatchConfigError(f"on rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} of {world}: "
                               f"{first} (every rank must read the same report)")
    planned = {tuple(other_parts) for other_parts, _ in results}
    if len(planned) > 1:
        raise PatchConfigError(f"the profile report {report} plans parts {sorted(map(list, planned))} on different "
                               "ranks: every rank must read the same report")
    return parts


def report_named_by(method: str) -> Optional[str]:
    """The report a partition_method names: 'profile:PATH', or 'profile' with $DS_PIPE_PARTITION_PROFILE; None for
    DeepSpeed's own methods."""
    if not names_a_profile(method):
        return None
    path = method.split(":", 1)[1] if ":" in method else os.environ.get(ENVIRONMENT)
    if not path:
        raise PatchConfigError(f"partition_method 'profile' needs a profile report: 'profile:PATH' or ${ENVIRONMENT}")
    return path


def profiled_parts(report_path: str, types: List[str], stages: int, limit: Optional[int] = None,
                   source: Optional[str] = None) -> List[int]:
    """The boundaries of `stages` stages the report's measured layers ask for (under a memory limit: see
    profiled_plan and cut_by)."""
    return profiled_cut(report_path, types, stages, limit, source).parts


def profiled_cut(report_path: str, types: List[str], stages: int, limit: Optional[int] = None,
                 source: Optional[str] = None) -> Cut:
    """What a PipelineModule of these layer types, cut into `stages` by the report, runs (cut_by)."""
    return cut_by(profiled_plan(report_path, types, stages, limit, source))


def profiled_plan(report_path: str, types: List[str], stages: int, limit: Optional[int] = None,
                  source: Optional[str] = None) -> dict:
    """The plan (report_plan.plan_of's dict) of `stages` stages the report's measured layers ask for, each stage's
    predicted peak within `limit` bytes where one is given and the report has its memory terms (memory_fits false:
    none is, the closest). PatchConfigError where the report cannot be read, profiles another model than `types`
    (this PipelineModule's layer types, in order), or cannot honour a limit from a flag or the environment
    (plan_of)."""
    report = read_report(report_path)
    layers = report.get("layers")
    if not layers:
        raise PatchConfigError(f"the profile report {report_path} has no layer table (a PipelineModule's run "
                               "profiled by this profiler has one): it cannot plan a partition")
    theirs = [row["type"] for row in layers]
    if theirs != types:
        differ = next((i for i, (a, b) in enumerate(zip(theirs, types)) if a != b), min(len(theirs), len(types)))
        raise PatchConfigError(
            f"the profile report {report_path} profiles another model: {len(theirs)} layers against this "
            f"PipelineModule's {len(types)}, the first difference at layer {differ} "
            f"({theirs[differ] if differ < len(theirs) else 'none'} there, "
            f"{types[differ] if differ < len(types) else 'none'} here)")
    if stages > len(layers):
        raise PatchConfigError(f"the profile report {report_path} has {len(layers)} layers: too few for {stages} "
                               "pipeline stages")
    try:
        return plan_of(report, PlanRequest(stages=stages, limit=limit, limit_source=source))
    except PatchConfigError as error:
        raise PatchConfigError(f"the profile report {report_path}: {error}") from None
