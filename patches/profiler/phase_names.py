"""The report's names of the three phases (fwd_flops, bwd_flops, recompute_flops, ...), with no torch import: the
commands that only read a report (megatron-profile-page prints it again) use them too. phases.py tells the phases
apart while a model runs."""

# The prefixes of the report's fields: fwd_flops, bwd_flops, recompute_flops, ...
PHASE_PREFIXES = ("fwd", "bwd", "recompute")


def phase_fields(suffix: str) -> tuple:
    """('fwd_<suffix>', 'bwd_<suffix>', 'recompute_<suffix>'): a report field for each phase."""
    return tuple(f"{prefix}_{suffix}" for prefix in PHASE_PREFIXES)
