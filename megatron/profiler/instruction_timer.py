"""Device-synchronized timers around every pipeline schedule instruction of a DeepSpeed engine.

PipelineEngine._exec_schedule looks each instruction up in `self._INSTRUCTION_MAP`; an instance
attribute of that name shadows the class's map, so timing one engine touches no class and no
other engine, and deleting the attribute restores the original exactly.
"""
import time
from collections import defaultdict


class InstructionTimer:
    def __init__(self, engine, synchronize):
        self.engine = engine
        self.synchronize = synchronize
        self.totals = defaultdict(float)
        self.counts = defaultdict(int)
        self.events = []  # (instruction name, kwargs, start, end): the schedule as it ran
        self._installed = False

    def timed(self, name, fn):
        """fn(engine, ...) wrapped with a synchronize and a clock read on both sides."""
        def run(engine, *args, **kwargs):
            self.synchronize()
            start = time.perf_counter()
            try:
                return fn(engine, *args, **kwargs)
            finally:
                self.synchronize()
                end = time.perf_counter()
                self.totals[name] += end - start
                self.counts[name] += 1
                self.events.append((name, kwargs, start, end))
        return run

    def reset(self):
        self.totals.clear()
        self.counts.clear()
        self.events = []

    def install(self):
        instruction_map = type(self.engine)._INSTRUCTION_MAP
        self.engine._INSTRUCTION_MAP = {
            instruction: self.timed(instruction.__name__, method) for instruction, method in instruction_map.items()}
        self._installed = True

    def remove(self):
        if self._installed:
            del self.engine._INSTRUCTION_MAP
            self._installed = False

    def as_dict(self):
        return {name: {"count": self.counts[name], "total_s": self.totals[name]} for name in sorted(self.counts)}
