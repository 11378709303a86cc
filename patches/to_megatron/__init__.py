"""What Megatron gets: the profiler's flags, the door a Megatron training loop runs its iterations through, and the
patches to a user's own upstream Megatron-DeepSpeed (`patches.apply_to_this_run()`, `--module patches.launch`)."""
