"""What ``prepare`` prints while it runs (``moe_train.data.progress``): the progress line, its
redraw on a terminal, and only the summary off one."""

from __future__ import annotations

import io
import re

from helpers import DOCS, write_txt

from moe_train.data import prepare, progress


def test_progress_line_shows_rate_share_and_eta():
    text = progress.line("tokenize", 1200, 3_400_000, 10.0, 25, 100)
    assert text == "tokenize: 1,200 docs, 3.40M tokens, 340.00k tok/s, 25% of 100B, ETA 30s"


def test_progress_on_a_terminal_redraws_one_line(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(progress, "TTY_EVERY_S", 0.0)
    stream = Tty()
    p = progress.Progress("tokenize", 100, stream)
    p.update(1, 10, 50)
    p.update(2, 20, 60)
    p.close()
    assert stream.getvalue().count("\r") == 2 and stream.getvalue().endswith("\n")


def test_a_short_run_off_a_terminal_prints_only_the_summary(bpe, tmp_path):
    stream, lines = io.StringIO(), []
    data = write_txt(tmp_path / "a.txt", DOCS)
    prepare.run(
        prepare.Options(tokenizer=str(bpe), inputs=(str(data),), out=tmp_path / "out", workers=1),
        log=lines.append,
        stream=stream,
    )
    assert stream.getvalue() == "" and lines[0].startswith(f"prepared {tmp_path / 'out'}")
    assert re.match(r"  train: [\d,]+ documents, [\d,]+ tokens \(uint16\), 1 shard$", lines[1])
