"""`python tools/compare_profiles.py ...` is the megatron-compare-profiles command, from megatron/cli/."""
import sys

from megatron.cli.compare_profiles import main

if __name__ == "__main__":
    sys.exit(main())
