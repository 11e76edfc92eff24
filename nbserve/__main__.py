"""`python -m nbserve serve MODEL`: the same as the `nbserve` command."""

import sys

from .serving.cli import main

sys.exit(main())
