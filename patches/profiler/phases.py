"""Which kind of work the calling thread is doing: forward, backward, or checkpoint recompute.

Inside `loss.backward()` the autograd engine runs a graph task. Backward kernels run in it with
grad mode off; activation checkpointing re-runs forward code in it with grad mode on (the reentrant
checkpoint calls `torch.enable_grad()` before recomputing, the non-reentrant one recomputes from a
saved-tensor unpack hook under grad mode). Everything outside a graph task is forward work, but for the
backward work a pipeline schedule runs outside autograd (a zero-bubble schedule's WeightPass), which the
module profiler marks as such (ModuleProfiler.backward_outside_autograd).
Double backward (`create_graph=True`) would read as recompute; training loops do not use it.
"""
import torch

FORWARD, BACKWARD, RECOMPUTE = 0, 1, 2
PHASES = (FORWARD, BACKWARD, RECOMPUTE)


_graph_task_id = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled


def current_phase() -> int:
    """The phase of an aten op dispatched now."""
    if _graph_task_id() == -1:
        return FORWARD
    return RECOMPUTE if _grad_enabled() else BACKWARD


def module_call_phase() -> int:
    """The phase of a module forward call starting now: a forward call inside backward is a recompute."""
    return FORWARD if _graph_task_id() == -1 else RECOMPUTE
