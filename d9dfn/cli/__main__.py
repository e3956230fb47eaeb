"""``python -m d9dfn.cli``: the command line (as ``d9dfn`` and ``python -m d9dfn``)."""

import sys

from d9dfn.cli import main

sys.exit(main())
