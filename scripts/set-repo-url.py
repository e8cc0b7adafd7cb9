"""Point the project at another GitHub repository (a fork), everywhere at once.

The repository URL's one source of truth is ``Repository`` in ``pyproject.toml``'s
``[project.urls]``. Other files must spell it out because they are read before anything is
installed or by services that read no configuration of ours: the notebooks' first cell (Colab
runs it to install accumcore from the repository), ``_config.yml`` (the book's Colab and
repository buttons), the README's install command and links into the published book (also the
package index page), the benchmark notebook's raw-file fallback. This script rewrites every
spelling of the current repository in the project's text files:

* ``github.com/OWNER/REPO`` (plain, ``.git``, ``/blob/...``, ``/issues``),
* ``raw.githubusercontent.com/OWNER/REPO``,
* ``colab.research.google.com/github/OWNER/REPO``,
* ``OWNER.github.io/REPO`` (the book on GitHub Pages; the host is lower-case),

then prints the files it changed. ``tests/test_docs_links.py`` checks that every place agrees.

Usage (from anywhere)::

    python scripts/set-repo-url.py https://github.com/ORG/REPO    # rewrite, print the changes
    python scripts/set-repo-url.py https://github.com/ORG/REPO --dry-run
    python scripts/set-repo-url.py --show                         # print the current URL

``--root DIR`` works on another checkout (the tests use a temporary copy).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
URL = re.compile(r"https://github\.com/(?P<owner>[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)/"
                 r"(?P<repo>[A-Za-z0-9._-]+?)(?:\.git)?/?")
REPOSITORY_LINE = re.compile(r'^Repository\s*=\s*"(?P<url>[^"]+)"', re.MULTILINE)
# Text files the URL may appear in (notebooks are JSON: a URL needs no escaping there).
SUFFIXES = {".md", ".toml", ".yml", ".yaml", ".ipynb", ".py", ".sh", ".cfg", ".txt", ".in",
            ".json"}
SKIP_PARTS = {".git", "_build", "node_modules", "__pycache__"}
SKIP_PREFIXES = ("book/_static/", ".venv")  # vendored MathJax; virtual environments


def parse(url: str) -> tuple[str, str]:
    """``(owner, repo)`` of ``https://github.com/OWNER/REPO`` (``.git`` and ``/`` allowed)."""
    match = URL.fullmatch(url.strip())
    if not match:
        raise ValueError(f"not a GitHub repository URL: {url!r} (expected "
                         "https://github.com/OWNER/REPO)")
    return match["owner"], match["repo"]


def current_url(root: Path) -> str:
    """The ``Repository`` entry of ``[project.urls]`` in ``root/pyproject.toml``."""
    text = (root / "pyproject.toml").read_text()
    section = text.split("[project.urls]", 1)
    match = REPOSITORY_LINE.search(section[1]) if len(section) == 2 else None
    if not match:
        raise SystemExit(f"set-repo-url: no `Repository = \"...\"` under [project.urls] in "
                         f"{root / 'pyproject.toml'}")
    return match["url"]


def project_files(root: Path) -> list[Path]:
    """The project's text files: git's tracked and untracked-but-not-ignored files where
    ``root`` is a git checkout, else every file below ``root``; vendored files excluded."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
            capture_output=True, text=True, check=True).stdout.splitlines()
        names = sorted(set(listed))
    except (OSError, subprocess.CalledProcessError):
        names = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    files = []
    for name in names:
        path = Path(name)
        if (path.suffix in SUFFIXES and not SKIP_PARTS & set(path.parts)
                and not name.startswith(SKIP_PREFIXES) and (root / path).is_file()):
            files.append(root / path)
    return files


def replacements(old: tuple[str, str], new: tuple[str, str]) -> list[tuple[re.Pattern, str]]:
    """(pattern, replacement) for every spelling of the old repository."""
    (old_owner, old_repo), (new_owner, new_repo) = old, new
    slug = rf"{re.escape(old_owner)}/{re.escape(old_repo)}(?![A-Za-z0-9_-])"
    flags = re.IGNORECASE  # GitHub owners and repositories are case-insensitive
    return [
        (re.compile(rf"(?<![\w.-])github\.com/{slug}", flags),
         f"github.com/{new_owner}/{new_repo}"),
        (re.compile(rf"raw\.githubusercontent\.com/{slug}", flags),
         f"raw.githubusercontent.com/{new_owner}/{new_repo}"),
        (re.compile(rf"colab\.research\.google\.com/github/{slug}", flags),
         f"colab.research.google.com/github/{new_owner}/{new_repo}"),
        (re.compile(rf"(?<![\w.-]){re.escape(old_owner)}\.github\.io/{re.escape(old_repo)}"
                    r"(?![A-Za-z0-9_-])", flags), f"{new_owner.lower()}.github.io/{new_repo}"),
    ]


def set_repo_url(root: Path, url: str, *, dry_run: bool = False) -> dict[Path, int]:
    """Rewrite every spelling of the current repository URL below ``root`` to ``url``.

    Returns ``{file: number of replacements}`` for the files that change.
    """
    new = parse(url)
    old = parse(current_url(root))
    changed: dict[Path, int] = {}
    if old == new:
        return changed
    rules = replacements(old, new)
    for path in project_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        count = 0
        for pattern, replacement in rules:
            text, n = pattern.subn(replacement, text)
            count += n
        if count:
            changed[path] = count
            if not dry_run:
                path.write_text(text, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", help="the new repository, https://github.com/ORG/REPO")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to change")
    parser.add_argument("--dry-run", action="store_true", help="only list what would change")
    parser.add_argument("--show", action="store_true", help="print the current URL and exit")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.show or args.url is None:
        print(current_url(root))
        return 0
    try:
        changed = set_repo_url(root, args.url, dry_run=args.dry_run)
    except ValueError as err:
        print(f"set-repo-url: {err}", file=sys.stderr)
        return 2
    verb = "would change" if args.dry_run else "changed"
    for path, count in changed.items():
        print(f"{verb} {path.relative_to(root)} ({count} URL{'s' if count > 1 else ''})")
    new_owner, new_repo = parse(args.url)
    print(f"set-repo-url: {len(changed)} files {verb}; the repository is now "
          f"https://github.com/{new_owner}/{new_repo}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
