"""The package as it would be published, and the workflow that publishes the book.

* The sdist and the wheel (``python -m build``) carry the Apache-2.0 LICENSE, ``py.typed``, the
  project URLs and the README as long description; the wheel installs into a fresh virtual
  environment and imports from there (``slow``: a build and a fresh interpreter that imports
  TensorFlow). ``scripts/test.sh`` builds the distributions once, runs ``twine check`` on them
  and passes them in ``$ACCUMCORE_DIST``; without it the tests build their own.
* ``.github/workflows/book.yml`` builds the full edition with the README's main command and
  deploys it to GitHub Pages on a push to main; actionlint accepts it and rejects a broken copy.
"""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "book.yml"


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# ---------------------------------------------------------------------------- sources
def test_license_is_the_apache_2_0_text_the_metadata_declares():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License")
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 150  # the full text
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    # PEP 639: no License :: classifier next to a license expression (setuptools refuses both)
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]
    assert "Typing :: Typed" in project["classifiers"]
    assert (ROOT / "accumcore" / "py.typed").is_file()


def test_changelog_has_the_version_being_packaged():
    version = _pyproject()["project"]["version"]
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[?{re.escape(version)}\]?", changelog, re.MULTILINE), (
        f"CHANGELOG.md has no section for {version}")
    import accumcore

    assert accumcore.__version__ == version


# ---------------------------------------------------------------------------- distributions
@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """A folder with the sdist and the wheel: ``$ACCUMCORE_DIST`` or a fresh build."""
    given = os.environ.get("ACCUMCORE_DIST")
    if given and list(Path(given).glob("*.whl")) and list(Path(given).glob("*.tar.gz")):
        return Path(given)
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


def _one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {folder}, found {found}"
    return found[0]


@pytest.mark.slow
def test_wheel_and_sdist_ship_license_types_urls_and_the_readme(dist):
    project = _pyproject()["project"]
    wheel = _one(dist, "accumcore-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = f"accumcore-{project['version']}.dist-info"
        metadata = email.message_from_bytes(zf.read(f"{info}/METADATA"))
        license_text = zf.read(f"{info}/licenses/LICENSE").decode()
    assert "accumcore/py.typed" in names and "accumcore/lab/__init__.py" in names
    assert not [n for n in names if n.startswith(("tests/", "book/", "benchmarks/"))]
    assert license_text == (ROOT / "LICENSE").read_text()
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["License-File"] == "LICENSE"
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert metadata.get_payload().strip() == (ROOT / "README.md").read_text().strip()
    urls = dict(u.split(", ", 1) for u in metadata.get_all("Project-URL"))
    assert urls == project["urls"]
    assert set(metadata.get_all("Classifier")) == set(project["classifiers"])

    sdist = _one(dist, "accumcore-*.tar.gz")
    with tarfile.open(sdist) as tf:
        members = {m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name}
    for required in ("LICENSE", "README.md", "CHANGELOG.md", "CONTRIBUTING.md", "pyproject.toml",
                     "accumcore/py.typed", "accumcore/__init__.py"):
        assert required in members, f"{required} missing from {sdist.name}"
    assert not [m for m in members if m.startswith("tests/")]  # no partial test suite


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_imports(dist, tmp_path):
    """A venv of its own: accumcore from the wheel (``--no-deps``), TensorFlow, Keras and NumPy
    from this interpreter's site-packages, appended after the venv's own by a ``.pth`` file (so
    nothing is downloaded and the editable checkout is not what gets imported)."""
    wheel = _one(dist, "accumcore-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    Path(purelib, "zz_test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", "--disable-pip-version-check", str(wheel)],
                   check=True, timeout=300)
    probe = (
        "import importlib.metadata as md, pathlib, accumcore, accumcore.lab\n"
        "files = {str(f) for f in md.files('accumcore')}\n"
        "print(accumcore.__file__)\n"
        "print(accumcore.__version__, md.metadata('accumcore')['License-Expression'])\n"
        "print((pathlib.Path(accumcore.__file__).parent / 'py.typed').is_file(),\n"
        "      any(f.endswith('licenses/LICENSE') for f in files))\n"
        "print(callable(accumcore.AccumModel), callable(accumcore.lab.load_mnist))\n"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONNOUSERSITE="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    location, versions, shipped, names = proc.stdout.strip().splitlines()[-4:]
    assert Path(location).resolve().is_relative_to(venv.resolve()), location
    assert versions == f"{_pyproject()['project']['version']} Apache-2.0"
    assert shipped == "True True" and names == "True True"


# ---------------------------------------------------------------------------- the workflow
def test_workflow_builds_the_full_edition_and_deploys_it_on_a_push_to_main():
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load(WORKFLOW.read_text())
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert triggers["push"]["branches"] == ["main"]
    build, deploy = workflow["jobs"]["build"], workflow["jobs"]["deploy"]
    runs = [step["run"].strip() for step in build["steps"] if "run" in step]
    assert runs == ["bash scripts/build-book.sh"]  # the README's main command, nothing else
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/build-book.sh   # main job" in readme
    assert "ACCUMCORE_QUICK" not in WORKFLOW.read_text()  # the full edition, never the quick one
    upload = [s for s in build["steps"] if s.get("uses", "").startswith(
        "actions/upload-pages-artifact@")]
    assert upload and upload[0]["with"]["path"] == "_build/html"
    assert deploy["needs"] == "build"
    assert deploy["permissions"] == {"pages": "write", "id-token": "write"}
    assert [s["uses"].split("@")[0] for s in deploy["steps"]] == ["actions/deploy-pages"]


def test_actionlint_accepts_the_workflow_and_rejects_a_broken_one(tmp_path):
    actionlint = shutil.which("actionlint")
    if actionlint is None:
        pytest.skip("actionlint is not installed (requirements.txt pins it)")
    ok = subprocess.run([actionlint, "-color=false", str(WORKFLOW)], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOW.read_text().replace("needs: build", "needs: bulid"))
    bad = subprocess.run([actionlint, "-color=false", str(broken)], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "bulid" in bad.stdout
