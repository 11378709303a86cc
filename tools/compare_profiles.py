"""`python tools/compare_profiles.py ...` is the megatron-compare-profiles command, from patches/cli/."""
import sys

from patches.cli.compare_profiles import main

if __name__ == "__main__":
    sys.exit(main())
