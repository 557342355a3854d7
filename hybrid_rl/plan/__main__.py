"""`python -m hybrid_rl.plan`: the memory planner's command line (cli.py)."""

import sys

from hybrid_rl.plan.cli import main

sys.exit(main())
