"""``python -m moe_train.score``: the entry point of ``moe_train.convert.score`` (score token ids)."""

import sys

from moe_train.convert.score import main

if __name__ == "__main__":
    sys.exit(main())
