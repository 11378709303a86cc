"""Weight initialisation shared by the model's layers."""
import contextlib
import math

import torch


def init_method_normal(std):
    def init_(tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)
    return init_


def scaled_init_method_normal(std, num_layers):
    """Output projections of each layer start smaller, by 1/sqrt(2 L), as in GPT-2 and Megatron."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


@contextlib.contextmanager
def seeded_init(seed):
    """Build a layer from its own seed, so its weights do not depend on which stage builds it.

    The default CPU generator is forked: the caller's random stream is left untouched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
