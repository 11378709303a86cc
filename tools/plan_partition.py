"""`python tools/plan_partition.py ...` is the megatron-plan-partition command, from patches/cli/."""
import sys

from patches.cli.plan_partition import main

if __name__ == "__main__":
    sys.exit(main())
