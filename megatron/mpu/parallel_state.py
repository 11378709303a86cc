"""Tensor, pipeline and data parallel process groups, laid out by DeepSpeed's topology.

Ranks follow `PipeModelDataParallelTopology` (axes pipe, data, model): the tensor ("model") rank
varies fastest, then data, then pipeline stage. With 8 ranks, tp=2, pp=2: tensor groups
{0,1},{2,3},..., data groups {0,2},{1,3},{4,6},{5,7}, pipeline groups {0,4},{1,5},{2,6},{3,7}.
The PipelineEngine builds its own grid from the same topology, so both agree on who is who.

The functions named get_model_parallel_* are DeepSpeed's `mpu` protocol; there, as in Megatron,
"model parallel" means tensor parallel (the engine's ZeRO and grad-norm code reduce over it).
"""
import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

_TOPOLOGY = None
# axis name in the topology -> (process group, global ranks of that group in group-rank order)
_GROUPS = {}

_AXIS_TENSOR = "model"
_AXIS_PIPELINE = "pipe"
_AXIS_DATA = "data"


def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1):
    """Build the topology and this rank's tensor, pipeline and data groups (a collective call)."""
    global _TOPOLOGY
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before initialize_model_parallel")
    if _TOPOLOGY is not None:
        raise RuntimeError("model parallel groups are already initialized")
    world_size = dist.get_world_size()
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if tp < 1 or pp < 1 or world_size % (tp * pp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by tensor parallel size {tp} "
                         f"x pipeline parallel size {pp}")
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world_size // (tp * pp))
    rank = dist.get_rank()
    groups = {}
    for axis in (_AXIS_TENSOR, _AXIS_PIPELINE, _AXIS_DATA):
        # new_group is collective: every rank creates every group, in the same order.
        for ranks in topology.get_axis_comm_lists(axis):
            group = dist.new_group(ranks=ranks)
            if rank in ranks:
                groups[axis] = (group, list(ranks))
    _GROUPS.update(groups)
    _TOPOLOGY = topology


def model_parallel_is_initialized():
    return _TOPOLOGY is not None


def destroy_model_parallel():
    """Forget the layout so it can be initialized again (the process groups themselves stay alive)."""
    global _TOPOLOGY
    _TOPOLOGY = None
    _GROUPS.clear()


def get_topology():
    _check_initialized()
    return _TOPOLOGY


def _check_initialized():
    if _TOPOLOGY is None:
        raise RuntimeError("model parallel groups are not initialized: call initialize_model_parallel first")


def _group(axis):
    _check_initialized()
    return _GROUPS[axis][0]


def _ranks(axis):
    _check_initialized()
    return _GROUPS[axis][1]


def _rank_in(axis):
    return _ranks(axis).index(dist.get_rank())


# Tensor parallel.

def get_tensor_model_parallel_group():
    return _group(_AXIS_TENSOR)


def get_tensor_model_parallel_world_size():
    return len(_ranks(_AXIS_TENSOR))


def get_tensor_model_parallel_rank():
    return _rank_in(_AXIS_TENSOR)


def get_tensor_model_parallel_src_rank():
    """Global rank of tensor rank 0 in this rank's tensor group (the source of broadcasts)."""
    return _ranks(_AXIS_TENSOR)[0]


# Pipeline parallel.

def get_pipeline_model_parallel_group():
    return _group(_AXIS_PIPELINE)


def get_pipeline_model_parallel_world_size():
    return len(_ranks(_AXIS_PIPELINE))


def get_pipeline_model_parallel_rank():
    return _rank_in(_AXIS_PIPELINE)


def is_pipeline_first_stage():
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage():
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


# Data parallel.

def get_data_parallel_group():
    return _group(_AXIS_DATA)


def get_data_parallel_world_size():
    return len(_ranks(_AXIS_DATA))


def get_data_parallel_rank():
    return _rank_in(_AXIS_DATA)


def get_data_parallel_group_ranks():
    """Global ranks of this rank's data group (DeepSpeed's groups module asks for them)."""
    return list(_ranks(_AXIS_DATA))


# DeepSpeed's mpu protocol: "model parallel" is tensor parallel.

def get_model_parallel_group():
    return get_tensor_model_parallel_group()


def get_model_parallel_world_size():
    return get_tensor_model_parallel_world_size()


def get_model_parallel_rank():
    return get_tensor_model_parallel_rank()
