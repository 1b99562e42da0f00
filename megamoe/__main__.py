"""``python -m megamoe``: the ``megamoe`` command."""

import sys

from .cli import main

sys.exit(main())
