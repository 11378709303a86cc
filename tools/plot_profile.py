"""`python tools/plot_profile.py ...` runs the megatron-plot-profile command (megatron/cli/plot_profile.py)."""
import sys

from megatron.cli.plot_profile import main

if __name__ == "__main__":
    sys.exit(main())
