"""Simulated replicas and counted reductions: the instruments of chapter 8 and the tests.

Neither is needed to train: :func:`replica_devices` splits the CPU into logical devices so that a
``MirroredStrategy`` has two replicas on a one-device machine (the book's chapter 8, the
distributed tests), and :class:`CountingCrossDeviceOps` records every cross-replica reduction a
strategy performs, which is how the book and the tests show that accumcore reduces once per
window. Both lived in
``accumcore._impl.distribute`` before; the library does not use them.
"""

from __future__ import annotations

import tensorflow as tf


def replica_devices(count: int = 2) -> list[str]:
    """``count`` devices for a MirroredStrategy: real GPUs if there are enough, else logical CPUs.

    Splitting the CPU into ``count`` logical devices must happen before TensorFlow initialises
    its devices (before the first op): call this first thing after ``import tensorflow``.

    Raises:
        RuntimeError: if TensorFlow already initialised its devices with fewer logical CPUs.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= count:
        return [f"/gpu:{i}" for i in range(count)]
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * count
        )
    except RuntimeError as err:
        if len(tf.config.list_logical_devices("CPU")) < count:
            raise RuntimeError(
                f"TensorFlow already initialised its devices, so the CPU cannot be split into "
                f"{count} logical devices any more: call `replica_devices({count})` right after "
                "`import tensorflow`, before any TensorFlow op (restart the kernel/process)."
            ) from err
    return [f"/cpu:{i}" for i in range(count)]


class CountingCrossDeviceOps(tf.distribute.ReductionToOneDevice):
    """Cross-device ops that record every reduction a strategy performs (Python side).

    Pass it as ``tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)``. Run eagerly
    (inside ``tf.function`` the Python side runs once per trace, not once per call).

    Attributes:
        batches: number of values in each batched reduction, in order.
        singles: reductions issued outside a batch (``strategy.reduce``, reading a SUM
            variable in cross-replica context).
    """

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []
        self.singles = 0
        self._depth = 0

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        self.batches.append(len(value_destination_pairs))
        self._depth += 1
        try:
            return super().batch_reduce_implementation(
                reduce_op, value_destination_pairs, options
            )
        finally:
            self._depth -= 1

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        if not self._depth:
            self.singles += 1
        return super().reduce_implementation(reduce_op, per_replica_value, destinations, options)
