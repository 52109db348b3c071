import sys

from megafp8.hf import main

sys.exit(main())
