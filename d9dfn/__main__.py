"""``python -m d9dfn``: the same command line as ``d9dfn``."""

import sys

from d9dfn.cli import main

if __name__ == "__main__":
    sys.exit(main())
