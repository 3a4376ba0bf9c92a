"""``python -m dilocox.plan``: the same as ``dilocox plan``."""

import sys

from dilocox.plan.cli import main

sys.exit(main())
