"""Run the ``polybroker`` command: ``python -m polybroker ...``."""

import sys

from polybroker.cli import main

sys.exit(main())
