"""`python tools/plot_profile.py ...` is the megatron-plot-profile command, from megatron/cli/."""
import sys

from megatron.cli.plot_profile import main

if __name__ == "__main__":
    sys.exit(main())
