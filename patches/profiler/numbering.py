"""Iteration numbers, one convention for every door: an iteration is numbered by the optimizer steps done before it
plus the door's first number: 1 in Megatron's numbering (its log's "iteration N", --profile-flops-step N, the
report of the user's own FlopsProfiler code), 0 in DeepSpeed's (the config section's profile_step, "Profile
Summary at step N"). The profile schedule, its clock and its report keep the numbers their door gives."""

MEGATRON_NUMBERING, DEEPSPEED_NUMBERING = 1, 0


def running_iteration(steps_done: int, first: int = MEGATRON_NUMBERING) -> int:
    """The number of the iteration that runs after `steps_done` optimizer steps (a training loop's completed
    iterations, or an engine's global_steps), in the numbering whose first iteration is `first`."""
    return steps_done + first
