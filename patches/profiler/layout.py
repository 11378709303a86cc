"""Where a rank sits in the pp x tp x dp grid of a DeepSpeed engine, and who sits where.

The one place that tells a PipelineEngine from a plain DeepSpeedEngine (runs_a_schedule, which EngineLayout.of
records as is_pipeline); every other part of the profiler reads the layout.
"""
from dataclasses import dataclass, field
from typing import List, Tuple

import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine


@dataclass(frozen=True)
class EngineLayout:
    """Where this rank sits in the pp x tp x dp grid, and who sits where (one place for both engines)."""
    stage: int
    tp_rank: int
    dp_rank: int
    pp: int
    tp: int
    dp: int
    topology: object = field(default=None, compare=False, repr=False)  # deepspeed ProcessTopology, or None
    # A PipelineEngine runs a schedule (timed instruction by instruction, inside train_batch); a plain
    # DeepSpeedEngine's forward, backward and step are the iteration. The one place that tells them apart.
    is_pipeline: bool = True

    @classmethod
    def of(cls, engine: DeepSpeedEngine) -> "EngineLayout":
        if runs_a_schedule(engine):
            grid = engine.grid
            if not hasattr(grid, "_topo"):  # private: the rank layout every report group is built from
                raise RuntimeError("the profiler cannot read this DeepSpeed's pipeline layout: "
                                   "PipelineParallelGrid has no _topo (ProcessTopology)")
            return cls(grid.get_stage_id(), grid.get_slice_parallel_rank(), grid.get_data_parallel_rank(),
                       grid.get_pipe_parallel_world_size(), grid.get_slice_parallel_world_size(),
                       grid.get_data_parallel_world_size(), grid._topo, is_pipeline=True)
        # A plain DeepSpeedEngine is one stage; its mpu (if any) gives the tensor layout.
        mpu = engine.mpu
        tp = mpu.get_model_parallel_world_size() if mpu is not None else 1
        tp_rank = mpu.get_model_parallel_rank() if mpu is not None else 0
        dp_rank = mpu.get_data_parallel_rank() if mpu is not None else dist.get_rank()
        topology = mpu.get_topology() if hasattr(mpu, "get_topology") else None
        return cls(0, tp_rank, dp_rank, 1, tp, dist.get_world_size() // tp, topology, is_pipeline=False)

    def __post_init__(self):
        # Read by every report and its gathering: computed once here, read as fields.
        object.__setattr__(self, "world_size", self.pp * self.tp * self.dp)
        object.__setattr__(self, "in_replica", self.dp_rank == 0)  # in the reported replica (dp rank 0)
        object.__setattr__(self, "stage_leaders", tuple(self.rank_of(s, 0, 0) for s in range(self.pp)))
        object.__setattr__(self, "replica_ranks", tuple(r for s in range(self.pp) for r in self.tensor_ranks(s)))

    world_size: int = field(init=False, repr=False)
    in_replica: bool = field(init=False, repr=False)
    stage_leaders: Tuple[int, ...] = field(init=False, repr=False)  # replica 0's tp-rank-0 ranks, by stage
    replica_ranks: Tuple[int, ...] = field(init=False, repr=False)  # replica 0's ranks, stage by stage

    def rank_of(self, stage: int, tp_rank: int, dp_rank: int) -> int:
        if self.topology is None:  # no topology: tensor rank fastest, then data (Megatron's order)
            return (stage * self.dp + dp_rank) * self.tp + tp_rank
        coords = {"pipe": stage, "data": dp_rank, "model": tp_rank}
        return self.topology.get_rank(**{axis: coords[axis] for axis in self.topology.axes})

    def tensor_ranks(self, stage: int) -> List[int]:
        """Replica 0's ranks of `stage`, by tp rank."""
        return [self.rank_of(stage, t, 0) for t in range(self.tp)]


def runs_a_schedule(engine: DeepSpeedEngine) -> bool:
    """A PipelineEngine (timed instruction by instruction), not a plain DeepSpeedEngine. Answerable before the
    engine has its grid (DeepSpeed makes its profiler first), where EngineLayout.of is not."""
    return isinstance(engine, PipelineEngine)
