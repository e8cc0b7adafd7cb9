"""accumcore: exact gradient accumulation for TensorFlow 2 / Keras 3.

One accumulated window of any micro-batch sizes produces the same optimizer update as one large
batch, to float round-off, for losses that are means over samples (or tokens).

Entry points:
    :class:`AccumTrainer`  custom loops (eager, ``tf.function``, whole-epoch graph, in-graph split)
    :class:`AccumModel`    ``model.fit`` with a ``train_step`` override
    :class:`AccumulationState`  the accumulators and counters all of them share
"""

from __future__ import annotations

__version__ = "0.1.0"


def _check_tensorflow() -> None:
    try:
        import tensorflow as tf
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "accumcore needs TensorFlow >= 2.16 (Keras 3). Install it with "
            "`pip install tensorflow` (or `tensorflow-cpu`), or `pip install accumcore[tf]`."
        ) from err
    import keras

    major_minor = tuple(int(p) for p in tf.__version__.split(".")[:2])
    if major_minor < (2, 16) or int(keras.__version__.split(".")[0]) < 3:
        raise ImportError(
            f"accumcore needs TensorFlow >= 2.16 with Keras 3; found TensorFlow "
            f"{tf.__version__} and Keras {keras.__version__}."
        )


_check_tensorflow()

from accumcore.batchnorm import WindowBatchNormalization, convert_batchnorm  # noqa: E402
from accumcore.config import resolve_accum_steps  # noqa: E402
from accumcore.errors import NonFiniteGradientError  # noqa: E402
from accumcore.loops import AccumTrainer, LoopHistory  # noqa: E402
from accumcore.model import AccumModel, WindowFlushCallback  # noqa: E402
from accumcore.state import AccumulationState  # noqa: E402

__all__ = [
    "AccumModel",
    "AccumTrainer",
    "AccumulationState",
    "LoopHistory",
    "NonFiniteGradientError",
    "WindowBatchNormalization",
    "WindowFlushCallback",
    "convert_batchnorm",
    "resolve_accum_steps",
]


# The MNIST loader moved to the book's lab (accumcore.lab); these names keep working without the
# library importing the lab up front.
_MOVED_TO_LAB = {"MNIST": "accumcore.lab.data", "load_mnist": "accumcore.lab.data"}


def __getattr__(name: str):
    if name in _MOVED_TO_LAB:
        import importlib

        return getattr(importlib.import_module(_MOVED_TO_LAB[name]), name)
    raise AttributeError(f"module 'accumcore' has no attribute {name!r}")
