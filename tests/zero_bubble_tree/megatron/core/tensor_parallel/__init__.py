"""See megatron/__init__.py."""
