"""The notebooks' first cell, as Colab runs it, installs accumcore and replaces nothing of Colab's.

Colab's runtime already holds TensorFlow, Keras and KerasHub (book/reference/versions.md names
the versions); the first code cell of every notebook pip-installs accumcore from the repository
when it is missing. Here that cell runs as on Colab (``google.colab`` found, ``accumcore`` not),
with ``subprocess.check_call`` recording the pip command instead of running it; the command then
runs in this interpreter's environment with the repository URL replaced by the built wheel
(``$ACCUMCORE_DIST`` from ``scripts/test.sh``'s package step, else a wheel built here) and
``--dry-run --report``: pip resolves exactly what the cell would install, and nothing but
accumcore may be in it. On the Colab leg (``scripts/test-stacks.sh colab``) this environment is
Colab's TensorFlow, Keras and KerasHub; every leg runs it against its own stack.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata as md
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))
# What Colab's runtime holds and the cell must leave as it is (names as pip normalises them).
COLAB_STACK = ("tensorflow", "tensorflow-cpu", "keras", "keras-hub", "numpy")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _first_code_cell(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "".join(next(c for c in cells if c["cell_type"] == "code")["source"])


def _commands_on_colab(source: str, monkeypatch) -> list[list[str]]:
    """The commands ``source`` hands to ``subprocess.check_call`` where ``google.colab`` exists
    and ``accumcore`` does not (every other module as in this environment)."""
    real_find_spec = importlib.util.find_spec

    def find_spec(name, package=None):
        if name == "accumcore":
            return None
        if name == "google.colab":
            return importlib.machinery.ModuleSpec(name, None)
        return real_find_spec(name, package)

    calls: list[list[str]] = []
    with monkeypatch.context() as patch:
        patch.setattr(importlib.util, "find_spec", find_spec)
        patch.setattr(subprocess, "check_call", lambda args, **_: calls.append(list(args)) or 0)
        exec(compile(source, "<first cell>", "exec"), {"__name__": "__colab_cell__"})
    return calls


def _wheel(tmp_path_factory) -> Path:
    given = os.environ.get("ACCUMCORE_DIST")
    wheels = sorted(Path(given).glob("accumcore-*.whl")) if given else []
    if wheels:
        return wheels[-1]
    # built from a copy: setuptools leaves build/ in the tree it builds in
    source = tmp_path_factory.mktemp("source")
    shutil.copytree(ROOT / "accumcore", source / "accumcore",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "CHANGELOG.md",
                 "CONTRIBUTING.md"):
        shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                           str(out), str(source)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return next(out.glob("accumcore-*.whl"))


def _would_install(pip_args: list[str], tmp_path: Path) -> dict[str, str]:
    """``python -m pip install --dry-run`` of ``pip_args`` here: {name: version} it would
    install (or reinstall), from pip's installation report."""
    report = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run",
                           "--disable-pip-version-check", "--report", str(report), *pip_args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    items = json.loads(report.read_text())["install"]
    return {_canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def _replaced(would_install: dict[str, str]) -> dict[str, tuple[str | None, str]]:
    """What an installation would change besides accumcore: {name: (installed, new)}."""
    return {name: (_installed(name), version) for name, version in would_install.items()
            if name != "accumcore"}


def _fake_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal, valid pure-Python wheel of ``name`` ``version`` with no files of its own."""
    info = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{info}/METADATA",
                    f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                    "Root-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", f"{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


@pytest.fixture(scope="module")
def colab_commands() -> dict[str, list[list[str]]]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return {p.name: _commands_on_colab(_first_code_cell(p), monkeypatch) for p in NOTEBOOKS}


def test_every_first_cell_pip_installs_accumcore_from_the_repository_on_colab(colab_commands):
    """Each notebook's first cell runs one pip command on Colab: ``pip install`` of the
    repository (``git+https://...``), through this kernel's interpreter."""
    assert len(colab_commands) >= 8
    for notebook, commands in colab_commands.items():
        assert len(commands) == 1, (notebook, commands)
        command = commands[0]
        assert command[:4] == [sys.executable, "-m", "pip", "install"], (notebook, command)
        sources = [a for a in command[4:] if not a.startswith("-")]
        assert len(sources) == 1 and sources[0].startswith("git+https://github.com/"), (
            notebook, command)


def test_the_first_cell_installs_nothing_when_accumcore_is_there():
    """Outside Colab (accumcore installed, as in CI) the cell runs no command at all."""
    calls: list = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess, "check_call", lambda args, **_: calls.append(args) or 0)
        for path in NOTEBOOKS:
            exec(compile(_first_code_cell(path), path.name, "exec"), {"__name__": "cell"})
    assert calls == []


def test_colab_install_replaces_no_tensorflow_keras_or_keras_hub(colab_commands,
                                                                  tmp_path_factory, tmp_path):
    """The cell's pip command, with the built wheel for the repository, would install accumcore
    and nothing else here: TensorFlow, Keras, KerasHub and NumPy keep their versions."""
    before = {name: _installed(name) for name in COLAB_STACK}
    assert before["keras"] and before["keras-hub"], before  # the stack the check is about
    assert before["tensorflow"] or before["tensorflow-cpu"], before
    wheel = str(_wheel(tmp_path_factory))
    commands = {tuple(c[4:]) for cmds in colab_commands.values() for c in cmds}
    for args in commands:
        pip_args = [wheel if a.startswith("git+") else a for a in args]
        would_install = _would_install(pip_args, tmp_path)
        assert "accumcore" in would_install, would_install  # the wheel was the one resolved
        assert _replaced(would_install) == {}, (
            f"`pip install {' '.join(args)}` on Colab would replace {_replaced(would_install)}")
    assert {name: _installed(name) for name in COLAB_STACK} == before


def test_the_check_sees_a_replaced_keras(tmp_path):
    """The same dry run and report, given a wheel that would replace Keras, names it (so the
    test above can fail)."""
    fake = _fake_wheel(tmp_path, "keras", "99.0")
    would_install = _would_install(["-q", "--no-deps", str(fake)], tmp_path)
    assert _replaced(would_install) == {"keras": (_installed("keras"), "99.0")}
