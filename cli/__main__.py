"""`python -m cli ...` is `blade ...` (the service starts its own subprocesses this way)."""

import sys

from cli.main import main

sys.exit(main())
