"""``python -m moe_train``: see ``moe_train.train.cli``."""

import sys

from moe_train.train.cli import main

sys.exit(main())
