"""Names upstream Megatron-DeepSpeed pickles into its checkpoints, so its checkpoints unpickle here."""
