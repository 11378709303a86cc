"""Megatron's --split and weighted --data-path arithmetic, and rank-0 logging for the data pipeline."""
import math
import re

import torch


def print_rank_0(message):
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def split_boundaries(splits_string, size):
    """Document boundaries [0, train_end, valid_end, size] for a --split such as '969,30,1' or '80/20'.

    Weights are normalised, each split gets round(fraction * size) documents, and any rounding surplus
    or deficit is taken off every boundary after the first, as Megatron does."""
    weights = [float(w) for w in re.split(r"[,/]", splits_string)][:3]
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    if total <= 0 or min(weights) < 0:
        raise ValueError(f"--split {splits_string!r} needs non-negative weights with a positive sum")
    bounds = [0]
    for weight in weights:
        bounds.append(bounds[-1] + int(round(weight / total * float(size))))
    surplus = bounds[-1] - size
    return [bounds[0]] + [b - surplus for b in bounds[1:]]


def parse_blend(data_prefix):
    """[w1, p1, w2, p2, ...] from --data-path -> (prefixes, weights normalised to sum 1)."""
    if len(data_prefix) % 2 != 0:
        raise ValueError(f"--data-path with several datasets takes weight/prefix pairs, got {data_prefix}")
    weights = [float(w) for w in data_prefix[0::2]]
    prefixes = [p.strip() for p in data_prefix[1::2]]
    total = sum(weights)
    if total <= 0 or min(weights) < 0:
        raise ValueError(f"--data-path weights must be non-negative with a positive sum, got {weights}")
    return prefixes, [w / total for w in weights]


def blend_num_samples(train_valid_test_num_samples, weight):
    """Samples to draw from one blended dataset: its share plus 0.5% so the blend never runs short."""
    return [int(math.ceil(n * weight * 1.005)) for n in train_valid_test_num_samples]
