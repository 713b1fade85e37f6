"""python -m host.cli: zl-host."""
import sys

from .zl_host import main

sys.exit(main())
