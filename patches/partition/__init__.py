"""Where to cut a pipeline, from what a profiled run measured: one place for the layer table, the plan and DeepSpeed's
`partition_method='profile'`.

- layers.py: a PipelineModule's layer list as the report names it (read by each rank's measurement);
- table.py: the report's layer table, built from the stages' measured module trees;
- planner.py: the partition that minimises the bounding stage, what it predicts, and a saved report's plan (no
  DeepSpeed or torch import: megatron-plan-partition starts at once);
- method.py: the DeepSpeed patch that makes `PipelineModule(partition_method='profile')` and
  --pp-partition-from-profile cut the layers where a report says.
"""
