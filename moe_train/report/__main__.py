"""``python -m moe_train.report RUN_DIR``: write RUN_DIR/report.html and RUN_DIR/report/*.png."""

from __future__ import annotations

import sys
from pathlib import Path

from moe_train.report import build
from moe_train.telemetry.files import run_dir_main


def main(argv: list[str] | None = None) -> int:
    """Build the report of one run directory; exit 2 when it is not a directory."""

    def work(run_dir: Path) -> list[str]:
        report = build(run_dir)
        skipped = (
            f"; {report.skipped_lines} cut or unreadable line(s) skipped" if report.skipped_lines else ""
        )
        return [f"wrote {report.html_path} ({len(report.figures)} figures in {run_dir / 'report'}{skipped})"]

    return run_dir_main(
        "python -m moe_train.report",
        __doc__,
        argv,
        work,
        help="a run's --out directory (running, finished or crashed)",
    )


if __name__ == "__main__":
    sys.exit(main())
