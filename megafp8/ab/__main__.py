"""``python -m megafp8.ab``: the same as ``megafp8-ab``."""

import sys

from megafp8.ab import main

if __name__ == "__main__":
    sys.exit(main())
