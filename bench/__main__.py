"""`python -m bench`: the whole suite (bench/lib/suite.py; bench/README.md)."""

import sys

from bench.lib.suite import main

sys.exit(main())
