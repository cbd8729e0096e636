"""The ground floor: what every package of the kit may import, and that imports none of them.

- ``exits``: the exit codes every command shares, and which errors are the file system
  refusing a write (``OutputError``, ``output_error``: exit 5).
- ``tomlfile``: ``read_toml``, the one TOML reader (each caller keeps its own error type).
- ``arith``: ``cdiv``, integer division rounding up.
- ``choices``: value tables that the config's validation and the code acting on the values
  share (``SCORE_FUNCTIONS``, ``BACKENDS``), kept once.
- ``notation``: the one table of shape letters (``x_TH``: [tokens, hidden]), ``LETTERS``.

May import: nothing of the kit (the standard library only), so that any package may import it
and no import of it can close a cycle.
"""
