"""pytest fixtures only; every shared helper lives in ``tests/helpers.py``."""

from __future__ import annotations

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
