"""``python -m layoutlang.cli`` (what torchrun runs)."""

import sys

from .main import main

sys.exit(main())
