"""`python -m kvfence ...`: the `kvfence` command, from any interpreter that can import the package (a
checkout on PYTHONPATH has no console script beside its interpreter)."""

import sys

from kvfence.cli import main

sys.exit(main())
