"""The MNIST loader: Keras download first, a local file when offline, never other data."""

from __future__ import annotations

import hashlib
import os

import keras
import numpy as np
import pytest

import accumcore as ac
import accumcore.lab.data  # noqa: F401
from accumcore.lab.data import MNIST, MNIST_PATH_ENV, load_mnist

SHARED_MNIST = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz")
SHARED_SHA256 = "06af5dfe73b70e3bc1c36439982b18a8d76803db9b544f6fdf838a37fbb01b64"


def _offline(monkeypatch):
    def fail():
        raise OSError("simulated: no internet")

    monkeypatch.setattr(keras.datasets.mnist, "load_data", fail)


def test_keras_download_is_tried_first(monkeypatch, tmp_path):
    tiny = ((np.zeros((2, 28, 28), "uint8"), np.array([1, 2], "uint8")),
            (np.zeros((1, 28, 28), "uint8"), np.array([3], "uint8")))
    monkeypatch.setattr(keras.datasets.mnist, "load_data", lambda: tiny)
    monkeypatch.setenv(MNIST_PATH_ENV, str(tmp_path / "never-read.npz"))
    data = load_mnist(verbose=False)
    assert data.source == "keras"
    assert data.y_train.tolist() == [1, 2]


def test_offline_without_a_file_names_both_options(monkeypatch):
    _offline(monkeypatch)
    monkeypatch.delenv(MNIST_PATH_ENV, raising=False)
    with pytest.raises(RuntimeError) as err:
        load_mnist(verbose=False)
    message = str(err.value)
    assert "keras.datasets.mnist.load_data()" in message and MNIST_PATH_ENV in message


def test_offline_with_a_missing_file_says_which_file(monkeypatch, tmp_path):
    _offline(monkeypatch)
    missing = tmp_path / "nope.npz"
    monkeypatch.setenv(MNIST_PATH_ENV, str(missing))
    with pytest.raises(RuntimeError, match="nope.npz"):
        load_mnist(verbose=False)


def test_a_file_in_the_wrong_layout_is_rejected(monkeypatch, tmp_path):
    _offline(monkeypatch)
    bad = tmp_path / "bad.npz"
    np.savez(bad, x_train=np.zeros((10, 28, 28), "uint8"), y_train=np.zeros(10, "uint8"),
             x_test=np.zeros((10, 28, 28), "uint8"), y_test=np.zeros(10, "uint8"))
    with pytest.raises(ValueError, match="x_train"):
        load_mnist(path=str(bad), verbose=False)


@pytest.mark.skipif(not os.path.isfile(SHARED_MNIST), reason="../shared/data/mnist.npz absent")
def test_offline_fallback_reads_the_real_mnist_and_reports_it(monkeypatch, capsys):
    with open(SHARED_MNIST, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == SHARED_SHA256
    _offline(monkeypatch)
    monkeypatch.setenv(MNIST_PATH_ENV, SHARED_MNIST)
    data = load_mnist()
    assert data.source.startswith("file:") and data.source.endswith("mnist.npz")
    assert "MNIST loaded from file:" in capsys.readouterr().out
    assert data.x_train.shape == (60000, 28, 28) and data.x_test.shape == (10000, 28, 28)
    assert data.y_train[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert data.y_test[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
    assert data.x_train.mean() == pytest.approx(33.318, abs=1e-3)


def test_preprocess_and_subset():
    images = np.full((3, 28, 28), 255, "uint8")
    assert ac.lab.data.preprocess(images).shape == (3, 784)
    assert ac.lab.data.preprocess(images, flatten=False).shape == (3, 28, 28, 1)
    assert float(ac.lab.data.preprocess(images).max()) == 1.0
    data = MNIST(images, np.arange(3), images, np.arange(3), source="keras")
    assert len(ac.lab.data.subset(data, 2, 1).x_train) == 2


@pytest.mark.skipif(not os.path.isfile(SHARED_MNIST), reason="../shared/data/mnist.npz absent")
def test_quiet_hides_the_failed_download_and_the_directory(monkeypatch, capsys):
    def noisy_fail():
        print("Downloading data from https://storage.googleapis.com/.../mnist.npz")
        raise OSError("simulated: no internet")

    monkeypatch.setattr(keras.datasets.mnist, "load_data", noisy_fail)
    monkeypatch.setenv(MNIST_PATH_ENV, SHARED_MNIST)
    data = load_mnist(quiet=True)
    out = capsys.readouterr().out
    assert "Downloading" not in out and os.path.dirname(os.path.abspath(SHARED_MNIST)) not in out
    assert "local copy, mnist.npz" in out  # still says which source was used
    assert data.source == "file:" + os.path.abspath(SHARED_MNIST)  # the full path is kept
    load_mnist()  # without quiet: Keras's line and the full path are shown
    out = capsys.readouterr().out
    assert "Downloading" in out and os.path.abspath(SHARED_MNIST) in out


def test_quiet_still_raises_when_no_source_works(monkeypatch):
    _offline(monkeypatch)
    monkeypatch.delenv(MNIST_PATH_ENV, raising=False)
    with pytest.raises(RuntimeError, match=MNIST_PATH_ENV):
        load_mnist(quiet=True)
