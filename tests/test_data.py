"""The MNIST loader: Keras download first, a local file when offline, never other data."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
from pathlib import Path

import keras
import numpy as np
import pytest

import accumcore as ac
import accumcore.lab
import accumcore.lab.benchmarking
import accumcore.lab.book
import accumcore.lab.data
import accumcore.lab.devices
import accumcore.lab.experiments
import accumcore.lab.memory_stats
import accumcore.lab.pitfalls
import accumcore.lab.plotting
import accumcore.lab.sequences  # noqa: F401
from accumcore.lab.data import MNIST, MNIST_PATH_ENV, load_mnist

SHARED_MNIST = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz")
BOOK = Path(__file__).resolve().parents[1] / "book"
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
    assert "MNIST loaded from the local file" in capsys.readouterr().out
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


def _noisy_offline(monkeypatch):
    """What Keras does without internet: print its download attempt, then fail."""
    def noisy_fail():
        print("Downloading data from https://storage.googleapis.com/.../mnist.npz")
        raise OSError("simulated: no internet")

    monkeypatch.setattr(keras.datasets.mnist, "load_data", noisy_fail)


@pytest.mark.skipif(not os.path.isfile(SHARED_MNIST), reason="../shared/data/mnist.npz absent")
def test_by_default_it_says_which_file_and_why_and_verbose_false_prints_nothing(monkeypatch,
                                                                                  capsys):
    _noisy_offline(monkeypatch)
    monkeypatch.setenv(MNIST_PATH_ENV, SHARED_MNIST)
    data = load_mnist()  # interactive use: Keras's line, then where the data came from and why
    out = capsys.readouterr().out
    assert "Downloading" in out
    assert (f"MNIST loaded from the local file {os.path.abspath(SHARED_MNIST)} "
            "(keras.datasets.mnist.load_data() failed: OSError)") in out
    assert data.source == "file:" + os.path.abspath(SHARED_MNIST)
    quiet = load_mnist(verbose=False)  # the book's pages: nothing at all
    assert capsys.readouterr().out == ""
    assert quiet.source == data.source and quiet.y_train[:3].tolist() == [5, 0, 4]


def test_the_keras_source_is_said_too_and_verbose_false_hides_its_download(monkeypatch, capsys):
    tiny = ((np.zeros((2, 28, 28), "uint8"), np.array([1, 2], "uint8")),
            (np.zeros((1, 28, 28), "uint8"), np.array([3], "uint8")))

    def download():
        print("Downloading data from https://storage.googleapis.com/.../mnist.npz")
        return tiny

    monkeypatch.setattr(keras.datasets.mnist, "load_data", download)
    load_mnist()
    out = capsys.readouterr().out
    assert "Downloading" in out and "MNIST loaded from keras.datasets.mnist" in out
    assert load_mnist(verbose=False).source == "keras"
    assert capsys.readouterr().out == ""


def test_errors_are_raised_whatever_verbose_says(monkeypatch):
    _offline(monkeypatch)
    monkeypatch.delenv(MNIST_PATH_ENV, raising=False)
    for verbose in (True, False):
        with pytest.raises(RuntimeError, match=MNIST_PATH_ENV):
            load_mnist(verbose=verbose)


def test_the_lab_spells_its_quiet_option_one_way():
    # `verbose` (as Keras's fit), never `quiet` or `silent`, in every public lab function.
    modules = [getattr(accumcore.lab, name) for name in
               ("benchmarking", "book", "data", "devices", "experiments", "memory_stats",
                "pitfalls", "plotting", "sequences")]
    other = [f"{module.__name__}.{name}({param})" for module in modules
             for name, function in vars(module).items()
             if inspect.isfunction(function) and not name.startswith("_")
             and function.__module__ == module.__name__
             for param in inspect.signature(function).parameters
             if param in ("quiet", "silent", "silence", "show_output")]
    assert other == []
    assert "verbose" in inspect.signature(load_mnist).parameters


def test_the_books_pages_load_mnist_quietly_and_say_nothing_of_the_source():
    """The same MNIST either way: where it came from is the build's machinery, not the
    reader's content (``load_mnist()`` prints it when asked)."""
    calls, pages = [], sorted(BOOK.glob("*.ipynb"))
    for page in pages:
        cells = json.loads(page.read_text(encoding="utf-8"))["cells"]
        for cell in cells:
            source = "".join(cell["source"])
            if cell["cell_type"] == "code":
                calls += [(page.stem, call) for call in re.findall(r"load_mnist\([^)]*\)", source)]
    assert len({stem for stem, _ in calls}) >= 8
    assert [(stem, call) for stem, call in calls if "verbose=False" not in call] == []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        assert "mnist_source" not in text and "download failed" not in text, page.name


def test_load_mnist_public_docs_do_not_name_the_build_machines_variable():
    """Round-16 reader C4: the offline variable of the book's build is not a reader's option
    (``path=`` is); the behaviour stays, the docstring does not show it."""
    assert MNIST_PATH_ENV not in (load_mnist.__doc__ or "")
