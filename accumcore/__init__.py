"""accumcore: exact gradient accumulation for TensorFlow 2 / Keras 3.

One accumulated window of any micro-batch sizes produces the same optimizer update as one large
batch, to float round-off: each micro-batch is weighted by exactly what Keras's own loss divided
it by (its samples, its sample-weight sum, or its valid elements under a Keras mask or
``ignore_class``: ``accumcore._impl.denominators``), and the window divides once by the sum.

Entry points:
    :func:`accumulate`     ``model.fit`` of a model you already have (in place, its class kept)
    :class:`AccumTrainer`  custom loops (eager, ``tf.function``, whole-epoch graph, in-graph split)
    :class:`AccumModel`    ``model.fit`` with a ``train_step`` override
    :class:`AccumulationState`  the accumulators and counters all of them share
"""

from __future__ import annotations

__version__ = "0.1.0"


def _check_tensorflow() -> None:
    """Raises ``ImportError`` naming the versions found and supported unless TF/Keras fit.

    Supported: TensorFlow >= 2.20 with Keras >= 3.13 (Keras 3 on the TensorFlow backend), the
    oldest stack CI runs; newer releases are not refused. CI tests two stacks, each on its own
    Python: the pinned newest on Python 3.11 (every test, and every notebook in the book's
    ``-W -n`` build) and Colab's runtime on Python 3.13 (the tests not marked ``slow``, and
    every notebook under nbval); pip enforces ``requires-python`` (>= 3.11). The book's
    "Supported versions" page (``book/reference/versions.md``) lists them, and TF 2.16-2.19
    with why they are not supported.
    """
    import re

    supported = (
        "accumcore supports TensorFlow >= 2.20 with Keras >= 3.13 on the TensorFlow backend "
        "(tested: TF 2.21.0 + Keras 3.15.1 on Python 3.11, TF 2.20.0 + Keras 3.13.2 on "
        "Python 3.13)"
    )

    def major_minor(version: str) -> tuple[int, int]:
        match = re.match(r"(\d+)\.(\d+)", version)
        return (int(match.group(1)), int(match.group(2))) if match else (0, 0)

    try:
        import tensorflow as tf
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"{supported}; found no TensorFlow ({err}). Install it with `pip install "
            "tensorflow` (or `tensorflow-cpu`), or `pip install accumcore[tf]`."
        ) from err
    try:
        import keras
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"{supported}; found TensorFlow {tf.__version__} and no Keras ({err}). Install it "
            "with `pip install \"keras>=3.13\"`."
        ) from err
    found = f"found TensorFlow {tf.__version__} with Keras {keras.__version__}"
    if major_minor(tf.__version__) < (2, 20) or major_minor(keras.__version__) < (3, 13):
        raise ImportError(
            f"{supported}; {found}. Upgrade with `pip install -U \"tensorflow>=2.20\" "
            "\"keras>=3.13\"` (Keras 2 / tf.keras is not supported)."
        )
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ImportError(
            f"{supported}; {found} on the {backend!r} backend. Set KERAS_BACKEND=tensorflow "
            "before importing keras."
        )


_check_tensorflow()

from accumcore._impl.accum_model import AccumModel, WindowFlushCallback  # noqa: E402
from accumcore._impl.batchnorm import WindowBatchNormalization, convert_batchnorm  # noqa: E402
from accumcore._impl.fitting import accumulate, flush  # noqa: E402
from accumcore._impl.nonfinite import NonFiniteGradientError, NonFinitePolicy  # noqa: E402
from accumcore._impl.settings import resolve_accum_steps  # noqa: E402
from accumcore._impl.state import AccumulationState  # noqa: E402
from accumcore._impl.trainer import AccumTrainer, LoopHistory  # noqa: E402

__all__ = [
    "AccumModel",
    "AccumTrainer",
    "AccumulationState",
    "LoopHistory",
    "NonFiniteGradientError",
    "NonFinitePolicy",
    "WindowBatchNormalization",
    "WindowFlushCallback",
    "accumulate",
    "convert_batchnorm",
    "flush",
    "resolve_accum_steps",
]

