"""Deferred weight-gradient work, with the interface of upstream's WeightGradStore (class methods
set_combine_bw, put(total_input, grad_output, weight, func), flush, pop): a backward pass puts its GEMMs here,
flush closes one backward pass's batch, and each pop runs the oldest batch."""
import collections


class WeightGradStore:
    combine_bw = True  # False while a BackwardOnlyPass runs: put keeps the work instead of running it
    pending = []
    batches = collections.deque()

    @classmethod
    def set_combine_bw(cls, combine_bw):
        cls.combine_bw = combine_bw

    @classmethod
    def put(cls, total_input, grad_output, weight, func):
        if cls.combine_bw:
            func(total_input, grad_output, weight)
        else:
            cls.pending.append((total_input, grad_output, weight, func))

    @classmethod
    def flush(cls):
        cls.batches.append(cls.pending)
        cls.pending = []

    @classmethod
    def pop(cls):
        for total_input, grad_output, weight, func in cls.batches.popleft():
            func(total_input, grad_output, weight)
