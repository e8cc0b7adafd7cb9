"""The book's laboratory: helpers the notebooks and benchmarks share, not the training library.

Nothing in :mod:`accumcore` proper imports this package; it is installed with accumcore only
because the book's notebooks (on Colab too) import it.

Modules:
    :mod:`accumcore.lab.data`          MNIST loading (Keras download, offline fallback) and subsets
    :mod:`accumcore.lab.experiments`   models and experiment drivers of chapters 1-5
    :mod:`accumcore.lab.pitfalls`      the broken recipes of chapter 6, each measured
    :mod:`accumcore.lab.sequences`     MNIST as padded row sequences, ignored labels (masks, tokens)
    :mod:`accumcore.lab.plotting`      the book's figures (titles, labels, units, palette)
    :mod:`accumcore.lab.benchmarking`  what chapter 7 runs live, and the benchmark suite
    :mod:`accumcore.lab.devices`       simulated replicas and counted reductions (chapter 8)
    :mod:`accumcore.lab.pretraining`   a small GPT-2 pretrained and saved as a KerasHub preset (3b)
"""

from accumcore.lab.data import MNIST, load_mnist

__all__ = ["MNIST", "load_mnist"]
