import sys

from megafp8.plan import main

sys.exit(main())
