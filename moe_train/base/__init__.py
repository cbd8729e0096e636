"""The ground floor: what every package of the kit may import, and that imports none of them.

- ``exits``: the exit codes every command shares, and which errors are the file system
  refusing a write (``OutputError``, ``output_error``: exit 5).
- ``tomlfile``: ``read_toml``, the one TOML reader (each caller keeps its own error type).
- ``arith``: ``cdiv``, integer division rounding up.
- ``choices``: value tables that the config's validation and the code acting on the values
  share (``SCORE_FUNCTIONS``, ``BACKENDS``), kept once.
- ``notation``: the one table of shape letters (``x_TH``: [tokens, hidden]), ``LETTERS``.
- ``platform``: ``Platform``, the target the model and the MoE layer choose kernels for
  (``Platform.here()``: this process's JAX backend, the one place that reads it).
- ``threads``: ``start_daemon``, the kit's background threads (named daemons).
- ``waiting``: ``Waiting``, the heartbeat around a blocking call (no silent wait over 10 s).
- ``calls``: ``from_names``, a call whose keyword arguments are another object's attributes of
  the same names (a parsed command line, a record a larger one repeats).

May import: nothing of the kit (the standard library only; ``platform`` also jax), so that any
package may import it and no import of it can close a cycle.
"""
