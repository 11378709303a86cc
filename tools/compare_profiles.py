"""`python tools/compare_profiles.py ...` runs the megatron-compare-profiles command (megatron/cli/compare_profiles.py)."""
import sys

from megatron.cli.compare_profiles import main

if __name__ == "__main__":
    sys.exit(main())
