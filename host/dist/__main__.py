"""python -m host.dist (under torchrun): zl-dist."""
import sys

from .ranks import main

sys.exit(main())
