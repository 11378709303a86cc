"""A stand-in for upstream Megatron-DeepSpeed's package layout, where its zero-bubble schedule keeps deferred
weight-gradient work (megatron.core.tensor_parallel.weight_grad_store): first on the path of
tests/scripts/zero_bubble_pipeline.py only. Written for the test; no upstream code."""
