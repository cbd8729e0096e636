"""``python -m moe_train``: see ``moe_train.train.cli``. A Ctrl-C while the trainer's modules
import (before ``cli.main`` installs its handlers) ends with one line and exit code 130."""

import sys

try:
    from moe_train.planner.memory import trainer as memory  # the planner's memory check, passed in
    from moe_train.train.cli import main
except KeyboardInterrupt:
    print("interrupted (Ctrl-C) while starting: nothing was run or written", file=sys.stderr, flush=True)
    sys.exit(130)

sys.exit(main(memory=memory))
