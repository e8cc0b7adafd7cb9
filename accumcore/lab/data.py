"""MNIST, loaded the way readers get it, with an offline fallback that says so.

``load_mnist()`` tries ``keras.datasets.mnist.load_data()`` first (what Colab readers get:
downloaded once, cached under ``~/.keras/datasets``). When that fails (no internet), it reads
a local ``mnist.npz`` in Keras's own layout, from the ``path`` argument or, for offline
machines, the environment variable ``ACCUMCORE_MNIST_PATH``. It never substitutes other data:
if neither source works, it raises an error naming both. It prints which source it used
(``verbose=False``: nothing).
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass

import numpy as np

#: Environment variable naming a local ``mnist.npz`` (Keras layout) used when offline.
MNIST_PATH_ENV = "ACCUMCORE_MNIST_PATH"

_KEYS = ("x_train", "y_train", "x_test", "y_test")
_SHAPES = {"x_train": (60000, 28, 28), "y_train": (60000,), "x_test": (10000, 28, 28),
           "y_test": (10000,)}


@dataclass
class MNIST:
    """MNIST arrays and where they came from.

    Attributes:
        x_train: (60000, 28, 28) uint8 images, pixel values 0..255.
        y_train: (60000,) uint8 labels 0..9.
        x_test: (10000, 28, 28) uint8.
        y_test: (10000,) uint8.
        source: ``"keras"`` (downloaded / Keras cache) or ``"file:<path>"``.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    source: str


def _read_npz(path: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as f:
        missing = [k for k in _KEYS if k not in f]
        if missing:
            raise ValueError(f"{path} is not an MNIST file in Keras's layout: missing {missing}.")
        arrays = {k: f[k] for k in _KEYS}
    for k, shape in _SHAPES.items():
        if arrays[k].shape != shape:
            raise ValueError(
                f"{path}: `{k}` has shape {arrays[k].shape}, expected {shape} (full MNIST)."
            )
    return arrays


def load_mnist(path: str | None = None, *, verbose: bool = True) -> MNIST:
    """Load MNIST: Keras's download first, then a local ``mnist.npz``.

    Args:
        path: a local ``mnist.npz`` (Keras's layout), read when the download fails: pass
            it to work offline. ``None`` (the default): no local file.
        verbose: print which source was used; ``False`` prints nothing, Keras's download
            lines included (``MNIST.source`` says it either way).

    Returns:
        An :class:`MNIST` with uint8 arrays and ``source``.

    Raises:
        RuntimeError: if the download fails and no local file is configured or readable.
    """
    try:
        import keras

        if verbose:
            (x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data()
        else:  # Keras prints its download attempt ("Downloading data from ...")
            with contextlib.redirect_stdout(io.StringIO()):
                (x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data()
        data = MNIST(x_train, y_train, x_test, y_test, source="keras")
        where = "keras.datasets.mnist (download/cache)"
    except Exception as download_error:  # noqa: BLE001 - any failure falls back to the file
        # Without ``path``, the environment variable names the file: how the book's build
        # and the tests load MNIST on machines without internet.
        local = path or os.environ.get(MNIST_PATH_ENV)
        if not local:
            raise RuntimeError(
                "Could not load MNIST: keras.datasets.mnist.load_data() failed "
                f"({type(download_error).__name__}: {download_error}), and no local file is "
                f"configured. Either connect to the internet, or pass `path=` / set "
                f"{MNIST_PATH_ENV} to an mnist.npz in Keras's layout."
            ) from download_error
        if not os.path.isfile(local):
            raise RuntimeError(
                f"Could not load MNIST: the Keras download failed ({download_error}) and the "
                f"local file {local!r} (from `path` or {MNIST_PATH_ENV}) does not exist."
            ) from download_error
        arrays = _read_npz(local)
        data = MNIST(**arrays, source=f"file:{os.path.abspath(local)}")
        where = (f"the local file {os.path.abspath(local)} (keras.datasets.mnist.load_data() "
                 f"failed: {type(download_error).__name__})")
    if verbose:
        print(f"MNIST loaded from {where}: {len(data.x_train)} train, {len(data.x_test)} test")
    return data


def preprocess(images: np.ndarray, *, flatten: bool = True) -> np.ndarray:
    """uint8 images (n, 28, 28) -> float32 in [0, 1], shape (n, 784) or (n, 28, 28, 1)."""
    x = images.astype("float32") / 255.0
    return x.reshape(len(x), -1) if flatten else x[..., None]


def subset(data: MNIST, n_train: int | None = None, n_test: int | None = None) -> MNIST:
    """The first ``n_train`` / ``n_test`` samples (for quick runs); ``None`` keeps all."""
    return MNIST(
        data.x_train[:n_train], data.y_train[:n_train], data.x_test[:n_test],
        data.y_test[:n_test], source=data.source,
    )
