"""The stacks CI tests, and every place that names them, agree: nothing is declared that CI does
not run.

The stacks are the pins of ``requirements.txt`` (the main leg: everything), on the Python of the
build that publishes the book (``.github/workflows/book.yml``; CI's machine has the same), and
the ``LEGS`` of ``scripts/test-stacks.sh`` (Colab's stack on Colab's Python, the declared
minimum). The versions page (``book/reference/versions.md``) has one row per stack with
its Python and what it is for a reader (the book's stack, Colab's), the README's "Supported
versions" names each with its Python,
``import accumcore`` accepts exactly down to the oldest of them (and its error names them all),
and ``pyproject.toml``'s extras ask for that minimum, its ``requires-python`` for the oldest
tested Python and its classifiers name exactly the tested Pythons.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import keras
import pytest
import tensorflow as tf

import accumcore as ac

ROOT = Path(__file__).resolve().parent.parent


class Stack(NamedTuple):
    name: str
    python: str  # "3.13": major.minor
    tensorflow: str
    keras: str
    keras_hub: str
    runs: str  # "tests" (main: every test, the book's build), "fast", "fast+nbval"


def _pin(path: Path, package: str) -> str:
    found = re.findall(rf"^{re.escape(package)}==(\S+)", path.read_text(), re.MULTILINE)
    assert len(found) == 1, (path.name, package, found)
    return found[0]


def _main_python() -> str:
    """The Python of the build that publishes the book (``.github/workflows/book.yml``)."""
    workflow = (ROOT / ".github/workflows/book.yml").read_text()
    found = re.findall(r'python-version: "(\d+\.\d+)"', workflow)
    assert len(found) == 1, found
    return found[0]


def stacks(script: str | None = None) -> list[Stack]:
    """The main stack, then the legs of ``scripts/test-stacks.sh`` (its ``LEGS`` array)."""
    script = script if script is not None else (ROOT / "scripts/test-stacks.sh").read_text()
    block = re.search(r"^LEGS=\(\n(.*?)^\)", script, re.MULTILINE | re.DOTALL)
    assert block, "scripts/test-stacks.sh has no LEGS=( ... ) array"
    legs = [line.strip().strip('"').split() for line in block.group(1).splitlines()
            if line.strip().startswith('"')]
    main = Stack("main", _main_python(), _pin(ROOT / "requirements.txt", "tensorflow-cpu"),
                 _pin(ROOT / "requirements.txt", "keras"),
                 _pin(ROOT / "requirements-no-deps.txt", "keras-hub"), "tests")
    return [main, *(Stack(name, python, tf_, keras_, hub, runs)
                    for name, _, python, tf_, keras_, hub, runs in legs)]


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def _minimum() -> tuple[tuple[int, int], tuple[int, int]]:
    """The oldest TensorFlow and the oldest Keras (major, minor) among the tested stacks."""
    return (min(_minor(s.tensorflow) for s in stacks()),
            min(_minor(s.keras) for s in stacks()))


def _section(text: str, heading: str) -> str:
    match = re.search(rf"^(#+) {re.escape(heading)}\n(.*?)(?=^#{{1,2}} |\Z)", text,
                      re.MULTILINE | re.DOTALL)
    assert match, f"no section {heading!r}"
    return match.group(2)


def _check_message(monkeypatch, tf_version: str, keras_version: str) -> str | None:
    """``accumcore``'s import check on these versions: None if it accepts, else its message."""
    monkeypatch.setattr(tf, "__version__", tf_version)
    monkeypatch.setattr(keras, "__version__", keras_version)
    monkeypatch.setattr(keras.backend, "backend", lambda: "tensorflow")
    try:
        ac._check_tensorflow()
    except ImportError as err:
        return str(err)
    return None


def test_the_stacks_are_read_from_the_script():
    found = stacks()
    assert [s.name for s in found][:2] == ["main", "colab"], found
    assert found[0].runs == "tests" and all(s.runs in ("fast", "fast+nbval") for s in found[1:])
    # the notebooks run once per stack: the main stack's in the book's build, one leg's in nbval
    assert [s.runs for s in found].count("fast+nbval") == 1, found
    assert len({(s.tensorflow, s.keras) for s in found}) == len(found), found  # all different
    assert all(re.fullmatch(r"3\.\d+", s.python) for s in found), found
    toy = 'LEGS=(\n  "old  .venv-old  3.9 2.1.0 3.2.0 0.1.0 fast"\n)\n'
    assert stacks(toy)[1:] == [Stack("old", "3.9", "2.1.0", "3.2.0", "0.1.0", "fast")]


def test_the_versions_page_has_one_row_per_tested_stack_saying_its_python_and_what_it_is():
    table = _section((ROOT / "book/reference/versions.md").read_text(),
                     "The two stacks it runs on")
    rows = [line for line in table.splitlines()
            if line.startswith(("| `tensorflow", "| TensorFlow "))]  # Colab: "TensorFlow 2.20.0"
    assert len(rows) == len(stacks()), rows  # no row for a stack no longer tested
    for stack, row in zip(stacks(), rows):
        for pin in (f"tensorflow-cpu=={stack.tensorflow}", f"keras=={stack.keras}",
                    f"keras-hub=={stack.keras_hub}"):
            assert pin in row, (stack, row)
        assert re.findall(r"Python (\d+\.\d+)", row) == [stack.python], (stack, row)
        what = row.rsplit("|", 2)[-2]
        # the leg whose notebooks run under nbval is Colab's: the page says so, for readers
        assert ("Colab" in what) == (stack.runs == "fast+nbval"), (stack, what)
        # the main stack is the one the book is printed on
        assert ("this book" in what) == (stack.runs == "tests"), (stack, what)


def test_the_readme_names_every_tested_stack_with_its_python_and_no_other():
    section = _section((ROOT / "README.md").read_text(), "Supported versions")
    named = re.findall(r"TF (\d+\.\d+\.\d+) \+ Keras (\d+\.\d+\.\d+)"
                       r"(?: with KerasHub [\d.]+)? on Python (\d+\.\d+)", section)
    assert len(named) == len(re.findall(r"TF \d", section)), section  # each with its Python
    assert sorted(named) == sorted((s.tensorflow, s.keras, s.python) for s in stacks()), named


def test_import_accepts_down_to_the_oldest_tested_stack_and_no_further(monkeypatch):
    (tf_major, tf_minor), (k_major, k_minor) = _minimum()
    oldest_tf, oldest_keras = f"{tf_major}.{tf_minor}.0", f"{k_major}.{k_minor}.0"
    assert _check_message(monkeypatch, oldest_tf, oldest_keras) is None
    for stack in stacks():
        assert _check_message(monkeypatch, stack.tensorflow, stack.keras) is None, stack
    older_tf = _check_message(monkeypatch, f"{tf_major}.{tf_minor - 1}.0", oldest_keras)
    older_keras = _check_message(monkeypatch, oldest_tf, f"{k_major}.{k_minor - 1}.0")
    assert older_tf is not None and older_keras is not None
    assert f"TensorFlow >= {tf_major}.{tf_minor} with Keras >= {k_major}.{k_minor}" in older_tf
    for stack in stacks():  # the error names every tested stack, with its Python
        tested = f"TF {stack.tensorflow} + Keras {stack.keras} on Python {stack.python}"
        assert tested in older_tf, (stack, older_tf)


@pytest.mark.parametrize("extra", ["tf", "cpu"])
def test_the_install_extras_ask_for_the_minimum(extra):
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    (tf_major, tf_minor), (k_major, k_minor) = _minimum()
    wanted = {f"{'tensorflow' if extra == 'tf' else 'tensorflow-cpu'}>={tf_major}.{tf_minor}",
              f"keras>={k_major}.{k_minor}"}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(project["optional-dependencies"][extra]) == wanted


def test_pyproject_declares_exactly_the_tested_pythons():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    tested = {s.python for s in stacks()}
    oldest = min(tested, key=_minor)
    assert project["requires-python"] == f">={oldest}"
    declared = {c.rsplit(" :: ", 1)[1] for c in project["classifiers"]
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)}
    assert declared == tested, (declared, tested)


def test_the_versions_page_and_the_readme_state_the_minimum():
    (tf_major, tf_minor), (k_major, k_minor) = _minimum()
    claim = f"TensorFlow >= {tf_major}.{tf_minor} with Keras >= {k_major}.{k_minor}"
    python = f"Python >= {min((s.python for s in stacks()), key=_minor)}"
    for page in ("README.md", "book/reference/versions.md"):
        text = (ROOT / page).read_text().replace("**", "")
        assert claim in text and python in text, page
        assert set(re.findall(r"Python >= (3\.\d+)", text)) == {python.split()[-1]}, page
