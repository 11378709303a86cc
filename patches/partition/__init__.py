"""Where to cut a pipeline and what each stage recomputes, from what a profiled run measured: one place for the layer
table, the plan, DeepSpeed's `partition_method='profile'` and the recompute per stage.

- layers.py: a PipelineModule's layer list as the report names it (read by each rank's measurement);
- table.py: the report's layer table, built from the stages' measured module trees;
- planner.py: the partition that minimises the bounding stage, and what it predicts; report_plan.py: a saved
  report's plan; plan_lines.py: a plan in words (no DeepSpeed or torch import in these three: megatron-plan-partition
  starts at once);
- method.py: where `PipelineModule(partition_method='profile')` (the patch: to_deepspeed/partition_method.py) and
  --pp-partition-from-profile cut the layers: the report's plan, agreed by every rank;
- recompute.py: which layers each stage recomputes (--pp-recompute-layers; the patch: to_deepspeed/stage_recompute.py);
  recompute_plan.py: the partition and each stage's recompute chosen together under a memory limit.
"""
