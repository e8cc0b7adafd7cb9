"""Exceptions raised by accumcore."""

from __future__ import annotations


class NonFiniteGradientError(FloatingPointError):
    """A micro-batch produced a NaN or Inf gradient (or one summing beyond the float range:
    ``accumcore.nonfinite``) under ``nonfinite="raise"``.

    The offending micro-batch was *not* added to the window: the accumulation state is exactly
    as it was before that micro-batch, so a checkpoint taken now loses nothing.

    Training stays stopped until the stop is cleared: the next ``AccumModel.fit`` /
    ``AccumTrainer.fit`` clears it (logged) and continues the kept window with its data; in a
    custom loop call ``state.clear_nonfinite()``. ``model.flush()`` / ``trainer.flush()``
    applies the kept window at once, ``state.drop_window()`` discards it.

    Attributes:
        micro_step: 0-based index of the offending micro-batch since training started.
        window_position: 0-based position of that micro-batch inside its window.
        variable: name of the first trainable variable whose gradient was not finite.
        epoch: 0-based epoch, when the caller knows it (else ``None``).
        unused_micro_batches: micro-batches seen after the offending one while the state was
            frozen, so not used (``fit`` checks once per epoch: the rest of that epoch).
    """

    def __init__(
        self,
        message: str,
        *,
        micro_step: int,
        window_position: int,
        variable: str,
        epoch: int | None = None,
        unused_micro_batches: int = 0,
    ) -> None:
        super().__init__(message)
        self.micro_step = micro_step
        self.window_position = window_position
        self.variable = variable
        self.epoch = epoch
        self.unused_micro_batches = unused_micro_batches
