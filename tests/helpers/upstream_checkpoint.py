"""Writes a checkpoint the way upstream Megatron-DeepSpeed does (pipeline via DeepSpeed, on CPU), from one of ours.

Upstream is not in this repository, so the tests of "upstream wrote it" use this writer, built from what
upstream's save_checkpoint documents and pickles (checked against real upstream runs in the upstream tier):
- DeepSpeed's files, `latest` naming `global_step<N>` and `latest_checkpointed_iteration.txt` holding N;
- in every mp_rank_XX_model_states.pt the client state: `args` (upstream's whole Namespace, its
  `model_type` a `megatron.core.enums.ModelType`), `checkpoint_version` 3.0, `iteration`, `tokens`,
  `universal_checkpoint_info`, and `rng_state`, a list of one dict per data-parallel rank;
- upstream's CPU optimizer is torch.optim.Adam: its param groups say `decoupled_weight_decay` False,
  and carry upstream's group names.
The weights, optimizer moments and scheduler are DeepSpeed's and stay as they are.
"""
import argparse
import shutil

import torch

from megatron.core.enums import ModelType

# The args upstream's load reads back (check_checkpoint_args and the consumed-sample counters), with the
# values upstream has where this fork has none.
READ_BY_UPSTREAM = ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                    "max_position_embeddings", "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type",
                    "tensor_model_parallel_size", "pipeline_model_parallel_size", "seq_length",
                    "consumed_train_samples")
UPSTREAM_ONLY = {"consumed_valid_samples": 0, "add_position_embedding": True, "data_parallel_random_init": False,
                 "universal_checkpoint": False, "model_type": ModelType.encoder_or_decoder}


def write_upstream_checkpoint(source, target, iteration):
    """Copy our checkpoint `source/global_step<iteration>` to `target` in upstream's client-state format."""
    tag = f"global_step{iteration}"
    shutil.copytree(source / tag, target / tag)
    for path in sorted((target / tag).glob("mp_rank_*_model_states.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        ours = state["args"]
        state["args"] = argparse.Namespace(**{name: getattr(ours, name) for name in READ_BY_UPSTREAM},
                                           **UPSTREAM_ONLY)
        state["rng_state"] = [dict(state["rng_state"][0])]
        state["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.2,
                                              "padded_vocab_size": ours.padded_vocab_size}
        for group, name in zip(state["optimizer"]["param_groups"], ("wd_no_scale_lr", "no_wd_no_scale_lr")):
            group.update(name=name, decoupled_weight_decay=False)
        torch.save(state, path)
    (target / "latest").write_text(tag)
    (target / "latest_checkpointed_iteration.txt").write_text(str(iteration))
