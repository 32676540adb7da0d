"""`python -m tokenmill ...`: the `tokenmill` command (tokenmill.cli), run as a module."""

import sys

if __name__ == "__main__":
    from tokenmill.cli import main

    sys.exit(main())
