"""``python -m whichdevice``: the same command as the ``whichdevice`` script."""

from __future__ import annotations

import sys

from whichdevice.cli import main

if __name__ == "__main__":
    sys.exit(main())
