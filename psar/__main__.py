"""`python -m psar` is the `psar` command."""

import sys

from psar.worker.cli import main

if __name__ == "__main__":
    sys.exit(main())
