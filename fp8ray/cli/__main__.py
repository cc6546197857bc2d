"""``python -m fp8ray.cli``: the same as the ``fp8ray`` command."""

import sys

from . import main

sys.exit(main())
