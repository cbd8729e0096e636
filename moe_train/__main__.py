"""``python -m moe_train``: see ``moe_train.cli``."""

import sys

from moe_train.cli import main

sys.exit(main())
