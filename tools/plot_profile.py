"""`python tools/plot_profile.py ...` is the megatron-plot-profile command, from patches/cli/."""
import sys

from patches.cli.plot_profile import main

if __name__ == "__main__":
    sys.exit(main())
