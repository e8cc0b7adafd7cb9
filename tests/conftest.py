"""pytest fixtures only; every shared helper lives in ``tests/helpers.py``."""

from __future__ import annotations

import gc

import numpy as np
import pytest

# Re-exported for test modules written against the old location (``from conftest import ...``,
# e.g. on branches merged later); new code imports from helpers.
from helpers import (  # noqa: F401
    ENTRIES,
    LOSS,
    OPTIMIZERS,
    REL_TOL,
    assert_matches_reference,
    dataset,
    make_data,
    reference_weights,
    small_mlp,
    train_entry,
    windows_of,
)


@pytest.fixture
def data() -> tuple[np.ndarray, np.ndarray]:
    """40 samples, 8 features, 3 classes (synthetic; equivalence does not depend on the data)."""
    return make_data()


def _gradient_registry() -> dict | None:
    """TensorFlow's global gradient registry (a private dict; ``None`` if TF moved it)."""
    from tensorflow.python.framework import ops

    return getattr(getattr(ops, "_gradient_registry", None), "_registry", None)


@pytest.fixture(autouse=True)
def _release_traced_graphs():
    """Let each test's traced graphs be freed when the test ends.

    Every traced ``optimizer.apply`` calls ``ReplicaContext.all_reduce``, which registers a
    ``tf.custom_gradient`` in TensorFlow's global gradient registry, and that entry keeps the
    whole traced graph alive for the rest of the process (tensorflow/tensorflow#97697). Over
    the suite that is about a million live objects per worker, which every full garbage
    collection walks (20-40 s per worker). The entries a test registered are dropped after it:
    no later test differentiates through an earlier test's graph.
    """
    registry = _gradient_registry()
    before = set(registry) if registry is not None else set()
    yield
    if registry is not None:
        for name in [n for n in registry if n not in before]:
            if name.startswith("CustomGradient-"):
                del registry[name]


# The modules imported above (TensorFlow, Keras, NumPy: about 320,000 objects) live for the
# whole session: move them out of the garbage collector's generations, so that its full
# collections walk only what the tests create (Python's documented use of gc.freeze).
gc.collect()
gc.freeze()
