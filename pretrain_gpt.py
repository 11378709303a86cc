"""Pre-train a GPT with pipeline, tensor and data parallelism on DeepSpeed (Megatron-DeepSpeed's flags).

    deepspeed --num_gpus 4 pretrain_gpt.py --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 ...
"""
import torch

from megatron.data_iterators import synthetic_datasets
from megatron.global_vars import get_args
from megatron.model import GPTModel, GPTModelPipe
from megatron.training import pretrain
from megatron.utils import print_rank_0


def model_provider():
    args = get_args()
    print_rank_0("> building GPT model ...")
    if args.no_pipeline_parallel:
        return GPTModel(args)
    return GPTModelPipe(args)


def forward_step(data_iterator, engine):
    """The --no-pipeline-parallel path: one micro-batch forward, returning the lm loss."""
    tokens, (labels, loss_mask) = next(data_iterator)
    device = engine.device
    return engine(tokens.to(device), labels.to(device), loss_mask.to(device))


def train_valid_test_datasets_provider(train_valid_test_num_samples):
    args = get_args()
    if not args.data_path:
        datasets = synthetic_datasets(args, train_valid_test_num_samples)
        print_rank_0(f"> no --data-path: using SYNTHETIC data (repeated random motifs, vocab {args.padded_vocab_size})")
        return datasets
    from megatron.data.gpt_dataset import build_train_valid_test_datasets
    from megatron.tokenizer import build_tokenizer

    build_tokenizer(args)  # sets args.padded_vocab_size; the data is already tokenized
    print_rank_0(f"> building train, validation and test datasets from {args.data_path} ...")

    def build():
        return build_train_valid_test_datasets(args.data_path, args.split, train_valid_test_num_samples,
                                               args.seq_length, args.seed, cache_dir=args.data_cache_path)

    # Rank 0 writes the cached sample indices (beside the data, or in --data-cache-path); the others read them.
    datasets = build() if torch.distributed.get_rank() == 0 else None
    torch.distributed.barrier()
    return datasets if datasets is not None else build()


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
             args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
