"""``python -m moe_train.planner`` (``make plan``): see ``moe_train.planner.show``."""

import sys

from moe_train.planner.show import main

sys.exit(main())
