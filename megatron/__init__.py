"""Megatron-style GPT pre-training on DeepSpeed: the patch set's first user."""

# This Megatron profiles through the patch set itself (its own --profile-flops-step): patches.launch leaves it alone.
PROFILES_WITH_PATCHES = True
