"""``python -m megafp8.verify``: the same as ``megafp8-verify``."""

import sys

from megafp8.verify import main

if __name__ == "__main__":
    sys.exit(main())
