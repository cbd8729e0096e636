"""``python -m moe_train.report RUN_DIR``: write RUN_DIR/report.html and RUN_DIR/report/*.png."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe_train.report import build


def main(argv: list[str] | None = None) -> int:
    """Build the report of one run directory; exit 2 when it is not a directory."""
    p = argparse.ArgumentParser(prog="python -m moe_train.report", description=__doc__)
    p.add_argument("run_dir", type=Path, help="a run's --out directory (running, finished or crashed)")
    args = p.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"error: {args.run_dir} is not a directory", file=sys.stderr)
        return 2
    report = build(args.run_dir)
    skipped = f"; {report.skipped_lines} cut or unreadable line(s) skipped" if report.skipped_lines else ""
    print(f"wrote {report.html_path} ({len(report.figures)} figures in {args.run_dir / 'report'}{skipped})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
