"""The model-type enum at the import path and with the member names and values upstream pickles.

Upstream stores its whole `args` in every checkpoint, `args.model_type` included; unpickling that
needs `megatron.core.enums.ModelType` to exist with the same members. This fork trains decoder-only
GPT models, so its own args say `encoder_or_decoder` too, and its checkpoints unpickle upstream.
"""
import enum


class ModelType(enum.Enum):
    encoder_or_decoder = 1
    encoder_and_decoder = 2
    retro_encoder = 3
    retro_decoder = 4
