"""``python -m moe_train.study`` (``make study``): the entry point of ``moe_train.bench.study``."""

import sys

from moe_train.bench.study import main

if __name__ == "__main__":
    sys.exit(main())
