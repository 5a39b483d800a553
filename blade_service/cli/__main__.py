"""`python -m blade_service.cli ...` is `blade ...` (the service starts its own subprocesses this way)."""

import sys

from blade_service.cli.main import main

sys.exit(main())
