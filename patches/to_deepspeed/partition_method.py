"""DeepSpeed's `PipelineModule(partition_method='profile')`, which raises NotImplementedError in every release, made
to cut the layers where a measured run says (the plan: patches/partition/method.py). Other methods are DeepSpeed's
own, unchanged.
"""
from deepspeed.runtime.pipe.module import PipelineModule

from patches.partition.method import parts_for
from patches.process import store

WHAT_IT_FIXES = "PipelineModule(partition_method='profile')"


def requires():
    return [(PipelineModule, "_partition_layers"), (PipelineModule, "_set_bounds"), *store.requires()]


def install():
    original = PipelineModule._partition_layers

    def _partition_layers(self, method="uniform"):
        """DeepSpeed gap: partition_method='profile' raises NotImplementedError in every release."""
        cut = parts_for(self, method)
        if cut is None:
            return original(self, method)
        self.parts = cut.parts
        self.planned_recompute = cut.recompute_layers  # what each stage recomputes: stage_recompute.py reads it
        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    PipelineModule._partition_layers = _partition_layers
