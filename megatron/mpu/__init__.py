"""Model parallel utilities: process groups, tensor-parallel layers, communication and RNG."""
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.mpu.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, vocab_parallel_weight
from megatron.mpu.mappings import (
                                   copy_to_tensor_model_parallel_region,
                                   gather_from_tensor_model_parallel_region,
                                   reduce_from_tensor_model_parallel_region,
                                   scatter_to_tensor_model_parallel_region,
)
from megatron.mpu.parallel_state import (
                                   destroy_model_parallel,
                                   get_data_parallel_group,
                                   get_data_parallel_group_ranks,
                                   get_data_parallel_rank,
                                   get_data_parallel_world_size,
                                   get_model_parallel_group,
                                   get_model_parallel_rank,
                                   get_model_parallel_world_size,
                                   get_pipeline_model_parallel_group,
                                   get_pipeline_model_parallel_rank,
                                   get_pipeline_model_parallel_world_size,
                                   get_tensor_model_parallel_group,
                                   get_tensor_model_parallel_rank,
                                   get_tensor_model_parallel_src_rank,
                                   get_tensor_model_parallel_world_size,
                                   get_topology,
                                   initialize_model_parallel,
                                   is_pipeline_first_stage,
                                   is_pipeline_last_stage,
                                   model_parallel_is_initialized,
)
from megatron.mpu.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.mpu.utils import VocabUtility, divide, split_tensor_along_last_dim
