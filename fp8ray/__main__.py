"""``python -m fp8ray``: the same as the ``fp8ray`` command (and ``python -m fp8ray.cli``)."""

import sys

from .cli import main

sys.exit(main())
