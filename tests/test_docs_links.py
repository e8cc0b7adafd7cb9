"""The documentation's references hold: named tests exist, the repository URL agrees everywhere,
the README's quickstart runs, and the browser check finds (or refuses to skip) a browser.

* Every test id written in the README, CONTRIBUTING.md or the book's Markdown pages
  (``tests/test_x.py::test_y``, a test file ``tests/test_x.py``, or a notebook
  ``book/NN_x.ipynb``) names a test that exists, so a rename cannot leave a dead reference.
  Every section of a Reference page (``book/reference/*.md``) that makes claims in a table names
  the test files that check it, on one comment line at its end (``% Tested in
  `tests/test_x.py` ...``: MyST does not render it, so readers never see it),
  and no other line of the section cites a test; every such table sits in a ``ref-table``
  container (the browser check measures those).
* The repository URL: ``Repository`` in ``pyproject.toml`` is the one source of truth; every
  place that must spell it out (``_config.yml``'s repository, which the Colab buttons use, every
  notebook's first cell, which Colab runs before anything is installed, the README, the project
  URLs) agrees, and no other GitHub repository of the same project is named anywhere.
  ``scripts/set-repo-url.py`` changes all of them at once (tested on a temporary copy).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_PAGES = ("README.md", "CONTRIBUTING.md", "CHANGELOG.md", "book/*.md", "book/reference/*.md")
TEST_ID = re.compile(r"\btests/(test_\w+\.py)(?:::(\w+)(?:::(\w+))?)?(?:\[[^\]\s`]*\])?")
NOTEBOOK_ID = re.compile(r"\bbook/(\w+\.ipynb)\b")


def _pages(root: Path = ROOT) -> list[Path]:
    return sorted({p for pattern in DOC_PAGES for p in root.glob(pattern)})


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"),
                                                  ROOT / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------- test ids
def defined_tests(path: Path) -> set[str]:
    """``name`` and ``Class::name`` of every test function a module defines (by its source,
    without importing it: test functions, methods, and ``test_x = ...`` assignments)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            names.update(f"{node.name}::{item.name}" for item in node.body
                         if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return {n for n in names if "test" in n.lower()}


_DEFINED: dict[Path, set[str]] = {}


def dead_references(text: str, root: Path = ROOT) -> list[str]:
    """The test ids and notebooks that ``text`` names and that do not exist under ``root``."""
    dead = []
    for match in TEST_ID.finditer(text):
        module, first, second = match.groups()
        path = root / "tests" / module
        if not path.is_file():
            dead.append(f"{match.group(0)} (no file tests/{module})")
            continue
        if first is None:
            continue
        name = f"{first}::{second}" if second else first
        if path not in _DEFINED:
            _DEFINED[path] = defined_tests(path)
        if name not in _DEFINED[path]:
            dead.append(f"{match.group(0)} (no test {name} in tests/{module})")
    for match in NOTEBOOK_ID.finditer(text):
        if not (root / "book" / match.group(1)).is_file():
            dead.append(f"{match.group(0)} (no such notebook)")
    return dead


def test_every_named_test_exists():
    found, dead = 0, []
    for page in _pages():
        text = page.read_text()
        found += len(TEST_ID.findall(text))
        dead += [f"{page.relative_to(ROOT)}: {d}" for d in dead_references(text)]
    assert not dead, "dead test references:\n" + "\n".join(dead)
    assert found > 30  # the Reference pages name their tests: the scan sees them


def test_a_renamed_test_is_reported(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(
        "def test_kept():\n    pass\n\n\nclass TestGroup:\n    def test_method(self):\n"
        "        pass\n")
    (tmp_path / "book").mkdir()
    (tmp_path / "book" / "01_x.ipynb").write_text("{}")
    good = ("`tests/test_a.py::test_kept`, `tests/test_a.py::test_kept[eager-nan]`, "
            "`tests/test_a.py::TestGroup::test_method`, `tests/test_a.py`, `book/01_x.ipynb`")
    assert dead_references(good, tmp_path) == []
    bad = ("`tests/test_a.py::test_renamed`, `tests/test_b.py::test_kept`, "
           "`tests/test_a.py::TestGroup::test_gone`, `book/02_y.ipynb`")
    assert len(dead_references(bad, tmp_path)) == 4


def table_rows(text: str) -> list[tuple[int, str, bool]]:
    """``(line number, row, inside a ref-table container)`` of every table body row."""
    rows, lines = [], text.splitlines()
    container = False
    for i, line in enumerate(lines):
        if line.startswith(":::{container}"):
            container = "ref-table" in line.split()
        elif line.strip() == ":::":
            container = False
        is_row = line.startswith("|") and not re.fullmatch(r"\|[\s:|-]+\|", line.strip())
        header = is_row and i + 1 < len(lines) and re.fullmatch(r"\|[\s:|-]+\|",
                                                                 lines[i + 1].strip())
        if is_row and not header:
            rows.append((i + 1, line, container))
    return rows


def rows_without_a_test(text: str) -> list[str]:
    """The table rows of ``text`` that name no test (or sit outside a ``ref-table``): the rule
    of the pages in :data:`ROW_CITATIONS`."""
    return [f"line {n}: {'not in a ref-table container; ' if not inside else ''}"
            f"{'no test named; ' if not (TEST_ID.search(row) or NOTEBOOK_ID.search(row)) else ''}"
            f"{row[:80]}"
            for n, row, inside in table_rows(text)
            if not inside or not (TEST_ID.search(row) or NOTEBOOK_ID.search(row))]


#: Reference pages whose tables still name a test in every row (the rule before one line per
#: section); a page leaves this set when it is rewritten to the section rule.
ROW_CITATIONS: set[str] = set()
TESTED_IN = "% Tested in "  # a MyST comment: kept in the source, off the rendered page


def sections(text: str) -> list[tuple[int, str, str]]:
    """``(line number, heading, text)`` of the lead (before the first heading) and of every
    section of a Markdown page; a ``#`` inside fenced code is not a heading."""
    found, start, heading, fenced = [], 0, "(lead)", False
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.append((start + 1, heading, "\n".join(lines[start:i])))
            start, heading = i, line
    found.append((start + 1, heading, "\n".join(lines[start:])))
    return found


def section_problems(text: str) -> list[str]:
    """What breaks the section rule in ``text`` (an empty list: nothing)."""
    problems = []
    for first, heading, body in sections(text):
        where = f"line {first} {heading[:60]!r}"
        rows = table_rows(body)
        citing = [line for line in body.splitlines()
                  if TEST_ID.search(line) or NOTEBOOK_ID.search(line)]
        tested = [line for line in citing if line.startswith(TESTED_IN)]
        if any(not inside for _, _, inside in rows):
            problems.append(f"{where}: a table outside a ref-table container")
        if rows and not tested:
            problems.append(f"{where}: claims in a table, and no '{TESTED_IN}...' line names "
                            "the test files that check them")
        if len(citing) > len(tested) or len(tested) > 1:
            problems.append(f"{where}: tests cited on {len(citing)} lines; one "
                            f"'{TESTED_IN}...' line per section names them all")
    return problems


def test_every_reference_section_names_its_tests():
    pages = sorted((ROOT / "book" / "reference").glob("*.md"))
    assert len(pages) >= 8
    problems, claims = [], 0
    for page in pages:
        text = page.read_text()
        if page.name in ROW_CITATIONS:
            problems += [f"{page.name}: {p}" for p in rows_without_a_test(text)]
            continue
        claims += sum(1 for _, _, body in sections(text) if table_rows(body))
        problems += [f"{page.name}: {p}" for p in section_problems(text)]
    assert not problems, "Reference sections without their tests:\n" + "\n".join(problems)
    assert claims >= 12  # the sections with tables were seen


def test_a_section_without_its_tests_is_reported():
    table = "| What | Result |\n| --- | --- |\n| held | yes |\n"
    wrapped = f":::{{container}} ref-table\n{table}:::\n"
    good = (f"# Page\n\nLead.\n\n## One\n\n{wrapped}\n% Tested in `tests/test_a.py`.\n\n"
            "## Prose only\n\nNo table, no test.\n\n```bash\n# a comment, not a heading\n```\n")
    assert section_problems(good) == []
    untested = f"# Page\n\n## One\n\n{wrapped}"
    assert [p.split(":")[0] for p in section_problems(untested)] == ["line 3 '## One'"]
    in_a_row = wrapped.replace("| held | yes |", "| held | `tests/test_a.py::test_b` |")
    assert len(section_problems(f"## One\n\n{in_a_row}\n% Tested in `tests/test_a.py`.\n")) == 1
    twice = f"## One\n\n{wrapped}\n% Tested in `tests/test_a.py`.\n% Tested in `tests/test_b.py`.\n"
    assert len(section_problems(twice)) == 1
    bare = f"## One\n\n{table}\n% Tested in `tests/test_a.py`.\n"  # no ref-table container
    assert len(section_problems(bare)) == 1
    # the heading inside the code block did not open a section: "## Prose only" holds it
    assert [h for _, h, _ in sections(good)] == ["(lead)", "# Page", "## One", "## Prose only"]


def test_a_row_without_a_test_is_reported():
    table = ("| What | Test |\n| --- | --- |\n| held | `tests/test_a.py::test_b` |\n"
             "| notebook | `book/08_x.ipynb` |\n| nothing holds this | - |\n")
    wrapped = f":::{{container}} ref-table\n{table}:::\n"
    assert [p.split(":")[0] for p in rows_without_a_test(wrapped)] == ["line 6"]
    assert len(rows_without_a_test(table)) == 3  # no container: every row is reported


def test_every_reference_page_is_in_the_book():
    toc = (ROOT / "_toc.yml").read_text()
    for page in (ROOT / "book" / "reference").glob("*.md"):
        assert f"- file: book/reference/{page.stem}\n" in toc, f"{page.name} is not in _toc.yml"


# ---------------------------------------------------------------------------- repository URL
GITHUB_URL = re.compile(
    r"(?:github\.com|raw\.githubusercontent\.com|colab\.research\.google\.com/github)/"
    r"(?P<owner>[A-Za-z0-9-]+)/(?P<repo>[A-Za-z0-9_.-]+?)(?=\.git\b|[/\"'`)\s#?@]|$)"
    r"|(?P<pages_owner>[a-z0-9-]+)\.github\.io/(?P<pages_repo>[A-Za-z0-9_.-]+?)(?=[/\"'`)\s]|$)")
# Other projects' repositories that the files may cite, and the placeholders of examples
# (`https://github.com/ORG/REPO`; the fork of the test below).
OTHER_OWNERS = {"keras-team", "tensorflow", "jupyter-book", "executablebooks", "actions",
                "rhysd", "kjanat", "mhchem", "google", "googlecolab",
                "org", "owner", "example-fork"}


def _repository(root: Path) -> str:
    text = (root / "pyproject.toml").read_text()
    match = re.search(r'^Repository\s*=\s*"([^"]+)"', text.split("[project.urls]", 1)[1],
                      re.MULTILINE)
    assert match, "pyproject.toml: no Repository under [project.urls]"
    return match.group(1)


def _project_files(root: Path) -> list[Path]:
    """The text files of the project: git's list in a checkout, else every file below root."""
    if (root / ".git").exists():
        names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                               cwd=root, capture_output=True, text=True, check=True).stdout
        candidates = [root / name for name in sorted(set(names.splitlines()))]
    else:
        candidates = sorted(root.rglob("*"))
    files = []
    for path in candidates:
        rel = path.relative_to(root).as_posix()
        if (path.is_file() and path.suffix in {".md", ".toml", ".yml", ".yaml", ".ipynb", ".py",
                                               ".sh", ".txt", ".cfg", ".in"}
                and not rel.startswith(("book/_static/", ".venv", "_build/", ".git/"))
                and "/.ipynb_checkpoints/" not in rel and ".egg-info" not in rel):
            files.append(path)
    return files


def url_problems(root: Path) -> list[str]:
    """Every place under ``root`` that spells the repository differently from pyproject's."""
    yaml = pytest.importorskip("yaml")
    url = _repository(root)
    match = re.fullmatch(r"https://github\.com/([A-Za-z0-9-]+)/([A-Za-z0-9_.-]+)", url)
    if not match:
        return [f"pyproject.toml: Repository {url!r} is not https://github.com/OWNER/REPO"]
    owner, repo = match.groups()
    pages = f"https://{owner.lower()}.github.io/{repo}/"
    problems = []

    urls = dict(re.findall(r'^(\w+)\s*=\s*"([^"]+)"',
                           (root / "pyproject.toml").read_text().split("[project.urls]", 1)[1]
                           .split("\n[", 1)[0], re.MULTILINE))
    expected = {"Homepage": url, "Documentation": pages, "Repository": url,
                "Issues": f"{url}/issues", "Changelog": f"{url}/blob/main/CHANGELOG.md"}
    if urls != expected:
        problems.append(f"pyproject.toml [project.urls]: {urls} != {expected}")

    config = yaml.safe_load((root / "_config.yml").read_text())["repository"]
    if config["url"] != url:
        problems.append(f"_config.yml repository.url {config['url']!r} != {url!r}")
    branch = config.get("branch", "main")

    install = f"git+{url}.git@{branch}"
    notebooks = sorted((root / "book").glob("*.ipynb"))
    for nb in notebooks:
        cells = json.loads(nb.read_text())["cells"]
        first = next(("".join(c["source"]) for c in cells if c["cell_type"] == "code"), "")
        if install not in first:
            problems.append(f"{nb.relative_to(root)}: the first code cell does not install "
                            f"{install}")

    readme = (root / "README.md").read_text()
    for needed in (f'pip install "git+{url}.git"', pages):
        if needed not in readme:
            problems.append(f"README.md does not contain {needed}")

    for path in _project_files(root):
        text = path.read_text(errors="replace")
        for m in GITHUB_URL.finditer(text):
            found_owner = m["owner"] or m["pages_owner"]
            found_repo = m["repo"] or m["pages_repo"]
            if found_owner.lower() in OTHER_OWNERS:
                continue
            if (found_owner.lower(), found_repo.lower()) != (owner.lower(), repo.lower()):
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{path.relative_to(root)}:{line}: {m.group(0)} is not "
                                f"{owner}/{repo}")
    return problems


def test_the_repository_url_agrees_everywhere():
    assert url_problems(ROOT) == []
    assert len(list((ROOT / "book").glob("*.ipynb"))) >= 8  # the install cells were checked


def _copy_of_the_project(tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        if (ROOT / name).is_file() and not name.startswith("book/_static/"):
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    return copy


def test_a_disagreeing_copy_is_reported(tmp_path):
    copy = _copy_of_the_project(tmp_path)
    url = _repository(copy)
    notebook = sorted((copy / "book").glob("*.ipynb"))[0]
    notebook.write_text(notebook.read_text().replace(url.split("github.com/")[1],
                                                     "stranger/elsewhere"))
    problems = url_problems(copy)
    assert any(notebook.name in p and "first code cell" in p for p in problems), problems
    assert any(notebook.name in p and "stranger/elsewhere" in p for p in problems), problems


def test_set_repo_url_changes_every_place_for_a_fork(tmp_path):
    copy = _copy_of_the_project(tmp_path)
    old = _repository(copy)
    script = ROOT / "scripts" / "set-repo-url.py"
    fork = "https://github.com/Example-Fork/accum-fork"
    proc = subprocess.run([sys.executable, str(script), fork, "--root", str(copy)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _repository(copy) == fork
    assert url_problems(copy) == [], proc.stdout
    old_slug = old.split("github.com/")[1]
    left = [p.relative_to(copy) for p in _project_files(copy) if old_slug in p.read_text()]
    assert left == [], f"{old_slug} still in {left}"
    assert "example-fork.github.io/accum-fork/" in (copy / "README.md").read_text()
    changed = proc.stdout.count("\nchanged ") + proc.stdout.startswith("changed ")
    assert changed >= 12  # README, pyproject, _config.yml, 8 notebooks, CONTRIBUTING, ...
    again = subprocess.run([sys.executable, str(script), fork, "--root", str(copy)],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "0 files changed" in again.stdout  # idempotent
    bad = subprocess.run([sys.executable, str(script), "https://gitlab.com/a/b", "--root",
                          str(copy)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not a GitHub repository URL" in bad.stderr


def test_colab_links_of_the_browser_check_come_from_the_config():
    pytest.importorskip("selenium")
    pytest.importorskip("yaml")
    browser_check = _load_script("browser_check.py")
    slug = _repository(ROOT).split("github.com/")[1]
    assert browser_check.colab_template().format("book/01_eager_loop") == (
        f"https://colab.research.google.com/github/{slug}/blob/main/book/01_eager_loop.ipynb")


# ---------------------------------------------------------------------------- README quickstart
def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, re.DOTALL)


def test_the_readme_quickstart_runs_as_written(monkeypatch, capsys):
    """The README's code, unchanged, on 256 MNIST-shaped samples (Keras's download is replaced
    by the same arrays, so the test needs no network)."""
    import keras
    import numpy as np

    blocks = _python_blocks((ROOT / "README.md").read_text())
    assert len(blocks) == 1 and "AccumModel" in blocks[0] and "window_step" in blocks[0]
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(256, 28, 28), dtype=np.uint8)
    y = rng.integers(0, 10, size=256).astype(np.uint8)
    monkeypatch.setattr(keras.datasets.mnist, "load_data", lambda: ((x, y), (x[:10], y[:10])))
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)  # noqa: S102 - the README's code
    model, trainer, history = namespace["model"], namespace["trainer"], namespace["history"]
    # 256 / 16 = 16 micro-batches, K = 4: 4 updates per epoch on each entry point, plus the
    # window_step update: the README's comments say what each call does.
    assert int(model.optimizer.iterations.numpy()) == 4
    assert history.updates == [4]
    assert int(trainer.optimizer.iterations.numpy()) == 5
    assert np.isfinite(float(namespace["loss"]))
    capsys.readouterr()


# ---------------------------------------------------------------------------- the browser
def _fake_executable(folder: Path, name: str) -> Path:
    path = folder / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def browser_check(monkeypatch):
    pytest.importorskip("selenium")
    pytest.importorskip("yaml")
    for name in ("ACCUMCORE_CHROMIUM", "ACCUMCORE_CHROMEDRIVER", "ACCUMCORE_SKIP_BROWSER", "CI"):
        monkeypatch.delenv(name, raising=False)
    return _load_script("browser_check.py")


def test_the_browser_is_found_on_path_or_named_by_the_environment(browser_check, tmp_path,
                                                                   monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setattr(browser_check, "MACOS_BROWSERS", ())
    monkeypatch.setattr(browser_check, "DRIVERS", ("chromedriver",))
    monkeypatch.setenv("PATH", str(bin_dir))
    assert browser_check.find_browser() == (None, None)
    chrome = _fake_executable(bin_dir, "google-chrome")
    assert browser_check.find_browser() == (str(chrome), None)  # Selenium finds a driver
    driver = _fake_executable(bin_dir, "chromedriver")
    chromium = _fake_executable(bin_dir, "chromium")  # earlier in the list than google-chrome
    assert browser_check.find_browser() == (str(chromium), str(driver))
    monkeypatch.setenv("ACCUMCORE_CHROMIUM", "/opt/my/chrome")
    monkeypatch.setenv("ACCUMCORE_CHROMEDRIVER", "/opt/my/chromedriver")
    assert browser_check.find_browser() == ("/opt/my/chrome", "/opt/my/chromedriver")


def test_no_browser_and_no_apt_fails_with_one_line_saying_what_to_do(browser_check, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setattr(browser_check, "find_browser", lambda: (None, None))
    monkeypatch.setenv("PATH", str(tmp_path))  # no apt-get
    assert browser_check.install_browser() is False
    with pytest.raises(SystemExit) as exit_:
        browser_check.make_driver(str(tmp_path), install_missing=True)
    message = str(exit_.value.code)
    assert "\n" not in message
    assert "apt-get install chromium chromium-driver" in message and "brew" in message
    assert "ACCUMCORE_SKIP_BROWSER=1" in message


def test_skipping_the_browser_check_works_locally_and_never_in_ci(browser_check, monkeypatch):
    assert browser_check.skip_requested() is False
    monkeypatch.setenv("ACCUMCORE_SKIP_BROWSER", "1")
    assert browser_check.skip_requested() is True
    monkeypatch.setenv("CI", "true")
    with pytest.raises(SystemExit, match="CI never skips"):
        browser_check.skip_requested()


# ---------------------------------------------------------------------------- README -> book
def book_links_without_a_page(readme: str, pages_url: str, toc: str) -> list[str]:
    """The README's links into the published book whose page ``_toc.yml`` does not list."""
    docnames = set(re.findall(r"^\s*(?:-\s*file|root):\s*(\S+)", toc, re.MULTILINE))
    links = re.findall(re.escape(pages_url) + r"([\w/.-]*?)\.html", readme)
    return [link for link in links if link not in docnames]


def test_readme_links_into_the_book_name_its_pages():
    readme = (ROOT / "README.md").read_text()
    owner, repo = _repository(ROOT).split("github.com/")[1].split("/")
    pages = f"https://{owner.lower()}.github.io/{repo}/"
    toc = (ROOT / "_toc.yml").read_text()
    assert book_links_without_a_page(readme, pages, toc) == []
    assert len(re.findall(re.escape(pages) + r"book/", readme)) >= 20  # the links were seen
    assert book_links_without_a_page(f"{pages}book/no_such_page.html", pages, toc) == [
        "book/no_such_page"]


# The test citations are MyST comments, unrendered: prose that points readers at them promises
# what the page does not show (a reader found "the test files named below" with none below).
_UNSHOWN_TESTS = re.compile(r"tests?(?: files)? (?:named|listed|cited) below|ends with the test"
                            r"(?: files)?|the library's tests", re.I)


def unshown_test_references(text: str) -> list[str]:
    """The rendered lines of a Markdown page (not ``%`` comments) that point at test names
    readers cannot see."""
    return [line.strip() for line in text.splitlines()
            if not line.lstrip().startswith("%") and _UNSHOWN_TESTS.search(line)]


def test_no_reference_page_points_readers_at_tests_they_cannot_see():
    assert unshown_test_references("The tests named below assert it.\n% Tested in `tests/a.py`.")
    assert unshown_test_references("% the tests named below: a comment\nA test holds it.") == []
    pages = sorted((ROOT / "book").glob("**/*.md"))
    problems = [f"{page.relative_to(ROOT)}: {line}" for page in pages
                for line in unshown_test_references(page.read_text())]
    assert not problems, "\n".join(problems)
