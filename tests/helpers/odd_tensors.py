"""Tensors whose storage cannot be read, as a user's process may hold them: what the profiler's memory
measurement must leave out, never fail on (tests/test_fail_safe.py, tests/scripts/pretrain_with_fault.py)."""
import torch


class NoStorage(torch.Tensor):
    """A wrapper subclass: a tensor object with a shape and no storage of its own (its data_ptr raises)."""

    @staticmethod
    def __new__(cls, size):
        return torch.Tensor._make_wrapper_subclass(cls, (size,), dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} on a tensor without storage")


def compiled_with_fake_tensors():
    """A torch.compile'd function, run once: the fake tensors compiling made stay alive with it."""
    @torch.compile(backend="eager")
    def doubled(x):
        return torch.relu(x) * 2

    doubled(torch.randn(4))
    return doubled


def odd_tensors():
    """By kind: tensors that hold no storage the allocator gave."""
    return {"meta": torch.empty(8, device="meta"), "sparse": torch.randn(4, 4).to_sparse(),
            "no storage": NoStorage(16), "empty": torch.empty(0)}
