"""Command-line tools installed as console scripts (megatron-plot-profile, megatron-compare-profiles)."""
