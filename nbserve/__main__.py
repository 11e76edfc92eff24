"""`python -m nbserve serve MODEL`: the same as the `nbserve` command."""

import sys

from .serving.cli import main

if __name__ == "__main__":
    sys.exit(main())
