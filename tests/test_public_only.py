"""The lab and the benchmarks use accumcore as its users do, and the library's imports point down.

* ``accumcore/lab``, ``benchmarks/`` and the book's notebooks use public names only: no import
  of ``accumcore._impl`` (in any form, lazy ones inside functions included), no private name
  imported from ``accumcore`` (``from accumcore.lab.x import _y``), no private attribute of
  another object (``obj._x``, ``getattr(obj, "_x")``); a class's own ``self._x`` / ``cls._x``
  is its business.
* The library's imports point down: ``accumcore.lab`` -> the public modules (``accumcore``,
  ``accumcore.memory``, ``accumcore.checkpointing``) -> ``accumcore._impl``. Nothing in
  ``accumcore._impl`` imports a public module or the lab; no public module imports the lab.
  Inside ``_impl`` calls go one way, entry point -> state -> rule: ``rule.py`` imports no
  state or entry point, ``state.py`` no entry point.

Checked on the source (``ast``), so a lazy import or a private attribute in a rarely run branch
is found too. The checker itself is tested on a snippet holding one of each violation.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "accumcore"
IMPL = LIBRARY / "_impl"

#: Modules of ``accumcore._impl`` that are entry points (each calls the state, then the rule).
ENTRY_POINTS = ("fitting", "trainer", "accum_model", "epoch_loop", "auto_micro_batch")


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``tree`` (nested ones included); ``from a import
    b`` counts as ``a.b`` as well as ``a`` (``b`` may be a submodule)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def private_uses(source: str, where: str) -> list[str]:
    """Every use in ``source`` of a private name of accumcore or of another object."""
    tree = ast.parse(source)
    found = [f"{where}:{line}: imports {module}" for line, module in sorted(set(
        (line, module.split(".")[0] + "._impl") for line, module in imported_modules(tree)
        if module == "accumcore._impl" or module.startswith("accumcore._impl.")))]
    for node in ast.walk(tree):
        if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("accumcore")
                and any(is_private(alias.name) for alias in node.names)):
            names = [alias.name for alias in node.names if is_private(alias.name)]
            found.append(f"{where}:{node.lineno}: imports private {node.module}.{names}")
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            owner = node.value
            own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
            own = own or (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
                          and owner.func.id == "super")
            if not own:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and is_private(node.args[1].value)):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and "accumcore._impl" in node.args[0].value
              and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                             "__import__")):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def notebook_source(path: Path) -> str:
    """The code cells of a notebook, IPython magics and shell lines left out."""
    cells = json.loads(path.read_text())["cells"]
    lines = []
    for cell in cells:
        if cell["cell_type"] == "code":
            source = "".join(cell["source"])
            lines += [line for line in source.splitlines()
                      if not line.lstrip().startswith(("%", "!"))]
            lines.append("")
    return "\n".join(lines)


def user_code() -> list[tuple[str, str]]:
    """``(where, source)`` of the lab, the benchmarks and the book's notebooks."""
    files = [*sorted((LIBRARY / "lab").rglob("*.py")), *sorted((ROOT / "benchmarks").rglob("*.py"))]
    code = [(str(p.relative_to(ROOT)), p.read_text()) for p in files]
    notebooks = [p for p in sorted((ROOT / "book").rglob("*.ipynb"))
                 if ".ipynb_checkpoints" not in p.parts]
    code += [(str(p.relative_to(ROOT)), notebook_source(p)) for p in notebooks]
    return code


def test_the_checker_finds_each_kind_of_private_use():
    snippet = "\n".join([
        "import accumcore._impl.state",
        "from accumcore._impl import nonfinite",
        "from accumcore import _impl",
        "from accumcore.lab.benchmarking import _dataset, build_model",
        "def f(trainer):",
        "    from accumcore._impl.trainer import AccumTrainer",
        "    trainer._micro_fn",
        "    getattr(trainer, '_epoch_fn')",
        "    importlib.import_module('accumcore._impl.rule')",
        "class A:",
        "    def g(self):",
        "        return self._mine, super()._theirs, self.__dict__, type(self).__name__",
    ])
    found = private_uses(snippet, "snippet")
    lines = sorted({int(f.split(":")[1]) for f in found})
    assert lines == [1, 2, 3, 4, 6, 7, 8, 9], found


def test_the_lab_the_benchmarks_and_the_notebooks_use_public_names_only():
    code = user_code()
    assert any(where.startswith("accumcore/lab/") for where, _ in code)
    assert any(where.startswith("benchmarks/") for where, _ in code)
    found = [use for where, source in code for use in private_uses(source, where)]
    assert not found, "\n".join(found)


def library_imports(path: Path) -> list[tuple[int, str]]:
    return [(line, module) for line, module in imported_modules(ast.parse(path.read_text()))
            if module == "accumcore" or module.startswith("accumcore.")]


def test_the_library_imports_point_down():
    """_impl imports only _impl; public modules never the lab."""
    library = [p for p in sorted(LIBRARY.rglob("*.py"))
               if "lab" not in p.relative_to(LIBRARY).parts]
    assert IMPL / "state.py" in library and LIBRARY / "memory.py" in library
    found = []
    for path in library:
        where = path.relative_to(ROOT)
        for line, module in library_imports(path):
            if module.startswith("accumcore.lab") or module == "accumcore.lab":
                found.append(f"{where}:{line}: imports the lab ({module})")
            elif IMPL in path.parents and not module.startswith("accumcore._impl"):
                if module != "accumcore" or not _only_impl_from_package(path, line):
                    found.append(f"{where}:{line}: _impl imports a public module ({module})")
    assert not found, "\n".join(found)


def _only_impl_from_package(path: Path, line: int) -> bool:
    """Whether the ``from accumcore import ...`` at ``line`` names only ``_impl``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.lineno == line and node.module == "accumcore":
            return all(alias.name == "_impl" for alias in node.names)
    return False


@pytest.mark.parametrize("module, forbidden", [
    ("rule", ("state", *ENTRY_POINTS)),
    ("state", ENTRY_POINTS),
])
def test_inside_impl_calls_go_entry_point_state_rule(module, forbidden):
    path = IMPL / f"{module}.py"
    assert path.exists(), f"{path} moved: update this test to the new layout"
    names = {f"accumcore._impl.{name}" for name in forbidden}
    found = [f"{module}.py:{line}: imports {m}" for line, m in library_imports(path)
             if m in names or any(m.startswith(n + ".") for n in names)]
    assert not found, "\n".join(found)


def test_the_import_checks_can_fail(tmp_path):
    """The direction checks find an upward import (a lazy one in a function)."""
    upward = tmp_path / "up.py"
    upward.write_text("def f():\n    from accumcore.memory import largest_fitting\n"
                      "    import accumcore.lab.data\n    from accumcore._impl import state\n")
    modules = [m for _, m in library_imports(upward)]
    assert "accumcore.memory" in modules and "accumcore.lab.data" in modules
    assert "accumcore._impl.state" in modules


# ------------------------------------------------------------------------ the lab's replacements
def test_the_labs_batchnorm_walk_finds_what_the_library_finds():
    """``accumcore.lab.experiments.batchnorm_layers`` (public Keras only) lists the layers, in
    the order, that the library's walk (``convert_batchnorm``'s) lists: nested models, a
    wrapper's inner layer, a shared layer once."""
    import keras

    from accumcore import WindowBatchNormalization
    from accumcore._impl.batchnorm import batchnorm_layers as library_walk
    from accumcore.lab.experiments import batchnorm_layers

    shared = keras.layers.BatchNormalization(name="shared")
    inner = keras.Sequential([keras.Input((4, 3)), keras.layers.Dense(3), shared,
                              keras.layers.TimeDistributed(keras.layers.BatchNormalization())])
    inputs = keras.Input((4, 3))
    h = WindowBatchNormalization(name="window")(inputs)
    h = inner(h)
    h = shared(h)
    model = keras.Model(inputs, keras.layers.BatchNormalization(name="last")(h))
    found = batchnorm_layers(model)
    assert len(found) == 4 and found[0].name == "window" and found[-1].name == "last"
    assert [id(layer) for layer in found] == [id(layer) for layer in library_walk(model)]


@pytest.mark.parametrize("loss", ["sparse_categorical_crossentropy", "mse_of_probabilities",
                                  "instance"])
def test_the_labs_keras_loss_is_the_loss_compile_makes(loss):
    """``accumcore.lab.experiments.keras_loss`` gives the value the library's reading of a
    ``compile`` loss gives (a mean over the batch), for a name, a function and a ``Loss``."""
    import keras
    import numpy as np

    from accumcore._impl.gradients import as_loss_fn
    from accumcore.lab.experiments import keras_loss

    def mse_of_probabilities(y_true, y_pred):  # per-sample values: to be averaged
        one_hot = keras.ops.one_hot(keras.ops.cast(y_true, "int32"), 3)
        return keras.ops.mean((one_hot - y_pred) ** 2, axis=-1)

    given = {"sparse_categorical_crossentropy": loss, "mse_of_probabilities":
             mse_of_probabilities, "instance": keras.losses.SparseCategoricalCrossentropy()}[loss]
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 8).astype("int32")
    y_pred = keras.ops.softmax(rng.normal(size=(8, 3)).astype("float32"))
    mine, library = keras_loss(given)(y, y_pred), as_loss_fn(given)(y, y_pred)
    assert mine.shape == () and float(mine) == pytest.approx(float(library), rel=1e-6)
    with pytest.raises(TypeError, match="`loss` must be"):
        keras_loss(3)
