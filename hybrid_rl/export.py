"""`python -m hybrid_rl.export <checkpoint> <hf_dir> [--dtype ...] [--merge]`: the command line of
checkpoint/export.py, kept at the package's top for the command users already type."""

import sys

from hybrid_rl.checkpoint.export import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
