"""DeepSpeed's `PipelineModule(partition_method='profile')`, which raises NotImplementedError in every release, made
to cut the layers where a measured run says.

    PipelineModule(layers, num_stages=2, partition_method="profile:profiles/flops_profile_step3.json")
    PipelineModule(layers, num_stages=2, partition_method="profile")   # the report in $DS_PIPE_PARTITION_PROFILE

The report is the profiler's JSON (flops_profile_stepN.json) of a run of the same layers: its per-layer table
gives each layer's measured forward, backward and recompute seconds, and the planner (planner.py)
cuts them into this module's num_stages, contiguous, no stage empty, the slowest stage as fast as it can be;
num_stages may differ from the profiled run's. One line on global rank 0 names the parts used. A report of
another model (another number of layers, or other layer types) is refused with PatchConfigError, one line.
Megatron runs name the report with --pp-partition-from-profile (megatron_flags.py), which cuts every
PipelineModule of the run this way whatever partition_method its code passes (use_for_every_pipeline).
Other methods are DeepSpeed's own, unchanged. Every rank reads the report and plans; the ranks then compare what
they planned through the default group's store (agreed_parts), so that a report missing on one node, or
another report on another, stops every rank in one line.
"""
import os
from typing import List, Optional

import torch.distributed as dist
from deepspeed.runtime.pipe.module import PipelineModule

from patches.errors import PatchConfigError
from patches.partition.layers import layer_types
from patches.partition.planner import plan_of, read_report
from patches.profiler import store_exchange
from patches.registry import REGISTRY

WHAT_IT_FIXES = "PipelineModule(partition_method='profile')"
METHOD = "profile"
ENVIRONMENT = "DS_PIPE_PARTITION_PROFILE"



def requires():
    return [(PipelineModule, "_partition_layers"), (PipelineModule, "_set_bounds"), *store_exchange.requires()]


def install():
    original = PipelineModule._partition_layers

    def _partition_layers(self, method="uniform"):
        """DeepSpeed gap: partition_method='profile' raises NotImplementedError in every release."""
        report = REGISTRY.settings.partition_report  # --pp-partition-from-profile
        if report is None and not names_a_profile(method):  # the same answer on every rank
            return original(self, method)
        try:
            report = report or report_named_by(method)
            parts, error = profiled_parts(report, layer_types(self), self.num_stages), None
        except PatchConfigError as problem:
            parts, error = None, str(problem)
        self.parts = agreed_parts(report, parts, error)
        if self.global_rank == 0:
            print(f"> partition_method 'profile' ({report}): parts {self.parts}, planned from its measured layers",
                  flush=True)
        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    PipelineModule._partition_layers = _partition_layers


def use_for_every_pipeline(report: Optional[str]) -> None:
    """Cut every PipelineModule built from now on by this report, whatever its partition_method (None: stop)."""
    REGISTRY.settings.partition_report = report


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
    results = store_exchange.every_ranks(f"partition_profile/module{REGISTRY.pipeline_modules_built}", (parts, error))
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


def profiled_parts(report_path: str, types: List[str], stages: int) -> List[int]:
    """The boundaries of `stages` stages the report's measured layers ask for. PatchConfigError where the report
    cannot be read or profiles another model than `types` (this PipelineModule's layer types, in order)."""
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
    return plan_of(report, stages)["parts"]
