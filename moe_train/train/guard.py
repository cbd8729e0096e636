"""What the loop does with a step whose loss, gradients or new state are not finite.

The train step (``moe_train.train.step.guard_nonfinite``) never lets a NaN/inf loss or gradient
reach the state: such a step leaves parameters, moments, expert bias and fp8 scales as they
were, and reports ``nonfinite``. It also reports ``params_finite`` for the parameters it was
given, i.e. the previous update's result. Here the host decides, by ``train.on_nonfinite``:

* ``stop`` (default): exit 3 at the first non-finite step. Nothing is saved past the last
  checkpoint, and every checkpoint holds finite values (``Checkpointer.save`` checks every
  array on the device and refuses others).
* ``skip``: the update is dropped, the step counter advances (the next step takes the next
  batch), a warning is logged and the record says ``"skipped": true``; after
  ``train.max_nonfinite_skips`` skipped steps in a row the run stops as with ``stop``.

A finite-gradient update that makes the parameters non-finite (an overflowing learning
rate) cannot be rolled back without a second copy of the state, so it stops the run in both
modes at the next step, and is never saved (a save right after it is refused). At the first
step of a start, non-finite parameters were never updated here: the message says the initial
weights are non-finite (a ``--resume-step`` of an unverified step holding NaN, say), not the learning rate.

Every divergence message ends with ``origin``: the checkpoint this start resumed from and
the newer ones that failed verification on the way (or the ``train.init_from`` weights).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from moe_train.train.resume import Resumed


class Divergence(Exception):
    """Training cannot go on from this state: one line, exit code 3."""


def _what(raw: dict[str, Any]) -> str:
    loss, norm = float(raw["total_loss"]), float(raw["grad_norm"])
    if not math.isfinite(loss):
        return f"loss is {loss}"
    return f"gradient norm is {norm} (loss {loss:.4g})"


def origin(resumed: Resumed | None, init_from: str) -> str:
    """Where this start's weights came from, for the divergence message ("" when fresh)."""
    if resumed is None:
        return f"the run started from train.init_from={init_from}" if init_from else ""
    parts = [
        f"this start resumed from {resumed.directory}"
        + (" (unverified: it has no manifest)" if resumed.unverified else "")
    ]
    parts += [
        f"checkpoint {r.step} failed verification at this start ({r.reason}) and was moved to {r.moved_to}"
        for r in resumed.rejected
    ]
    return "; ".join(parts)


class NonFiniteGuard:
    """Counts skipped steps and raises Divergence when the run must stop."""

    def __init__(self, train_cfg, log: Callable[[str], None], first: int = 0):
        self.mode, self.limit, self.log = train_cfg.on_nonfinite, train_cfg.max_nonfinite_skips, log
        self.first = first  # the step this start began after: its weights were not updated here
        self.in_a_row, self.total = 0, 0

    def check(self, step: int, raw: dict[str, Any]) -> dict[str, Any]:
        """Fields for the step's record; raises Divergence when the run must stop."""
        if not bool(raw["params_finite"]) and step == self.first + 1:
            raise Divergence(
                f"step {step}: the initial weights are non-finite (NaN or inf "
                f"before any update of this start); nothing was trained or saved"
            )
        if not bool(raw["params_finite"]):
            raise Divergence(
                f"step {step}: the parameters are non-finite after the update of "
                f"step {step - 1}, whose loss and gradients were finite (learning "
                f"rate too high?); not saved"
            )
        if not bool(raw["nonfinite"]):
            self.in_a_row = 0
            return {"skipped": False, "nonfinite_skips": self.total}
        if self.mode == "stop":
            raise Divergence(
                f"step {step}: {_what(raw)}; the update was not applied and "
                f"nothing was saved (train.on_nonfinite=stop; lower optim.lr, "
                f"raise optim.warmup_steps or set train.on_nonfinite=skip)"
            )
        self.in_a_row, self.total = self.in_a_row + 1, self.total + 1
        if self.in_a_row > self.limit:
            raise Divergence(
                f"step {step}: {_what(raw)}; {self.in_a_row} non-finite steps in "
                f"a row (train.max_nonfinite_skips={self.limit}); not saved"
            )
        self.log(
            f"WARNING: step {step}: {_what(raw)}; update skipped ({self.in_a_row} in a row, "
            f"{self.total} this start; train.max_nonfinite_skips={self.limit})"
        )
        return {"skipped": True, "nonfinite_skips": self.total}
