"""Exceptions raised by accumcore."""

from __future__ import annotations


class NonFiniteGradientError(FloatingPointError):
    """A window's gradient was not finite (NaN or Inf, or elements summing beyond the float
    range) under ``nonfinite="raise"``.

    That window was discarded whole, unapplied; the windows before it are applied and
    untouched, so a checkpoint taken now holds no NaN. Training stays stopped (later windows
    are discarded) until the stop is cleared: the next ``fit`` clears it (logged); in a custom
    loop call ``state.clear_nonfinite()``.

    Attributes:
        window: 0-based index of the bad window since training started.
        first_micro_step: 0-based index (over the run) of its first micro-batch.
        micro_batches: how many micro-batches it held.
        variable: name of the first trainable variable whose window gradient was not finite.
        epoch: 0-based epoch, when the caller knows it (else ``None``).
        unused_micro_batches: micro-batches seen after the bad window while training was
            stopped, so not used (``fit`` checks once per epoch: the rest of that epoch).
    """

    def __init__(self, message: str, *, window: int, first_micro_step: int, micro_batches: int,
                 variable: str, epoch: int | None = None, unused_micro_batches: int = 0) -> None:
        super().__init__(message)
        self.window = window
        self.first_micro_step = first_micro_step
        self.micro_batches = micro_batches
        self.variable = variable
        self.epoch = epoch
        self.unused_micro_batches = unused_micro_batches
