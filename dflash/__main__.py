import sys

from dflash.cli import main

sys.exit(main())
