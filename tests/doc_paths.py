"""Finds the repository paths and stepmill module names that text names, and says which do not exist.

Used by tests/test_docs.py on the README, the documentation pages and the comments and docstrings of
the code. A path counts only when it starts at one of the repository's top folders (`store/db.py`,
`tests/test_architecture.py`, `.ci/run`), so prose ("and/or", `/v1/steps`, `<db>.journal/<id>`, a
URL's path) is never read as one; a module name counts when it starts with `stepmill.` and is not a
file or a host (`stepmill.db`, `http://stepmill.local/`). A Markdown link's target on a page under
docs/ is relative to that page's folder.
"""

from __future__ import annotations

import ast
import io
import posixpath
import re
import tokenize
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The repository's top folders: a path in prose is one only when it starts at one of these.
TOP_FOLDERS = ("addon", "bench", "docs", "stepmill", "store", "tests", "trainer_bridge", ".ci")
# Where the installed namespace's packages live (pyproject.toml's package-dir), longest name first.
PACKAGE_FOLDERS = tuple(sorted(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
                               ["tool"]["setuptools"]["package-dir"].items(), key=lambda item: -len(item[0])))
# Folders that hold no text of the project's own.
SKIPPED_FOLDERS = {".git", ".venv", ".engines", ".agents", "__pycache__", "site", "node_modules"}

_BEFORE = r"(?<![\w./~:@$<>{}%-])"  # not inside a longer path, a URL, a placeholder or a word
PATH = re.compile(_BEFORE + r"(?:" + "|".join(re.escape(f) for f in TOP_FOLDERS) + r")/[\w./-]*(?:::\w+)?")  # a test's name after ::
MODULE = re.compile(_BEFORE + r"stepmill(?:\.\w+)+(?::\w+(?:\.\w+)*)?")
# What follows a name that is a pattern or a placeholder, not a path: `tests/test_*.py`, `docs/{page}`.
_PATTERN_NEXT = set("*{<[$…")
# `stepmill.<x>` that are files, hosts or distributions, not modules.
_NOT_MODULES = {"db", "local", "egg", "toml", "json", "jsonl", "log"}


@dataclass(frozen=True)
class Name:
    """A path or a module name found in a text, and where: `source` is the file, `line` its line."""

    text: str
    kind: str  # "path" or "module"
    source: str
    line: int


def names_in(text: str, source: str = "<text>", first_line: int = 1, page_folder: str = "") -> list[Name]:
    """Every repository path and stepmill module name in `text`, in order; `page_folder` is the folder
    of the Markdown page the text is, for its links' targets."""
    found = []
    for match in PATH.finditer(text):
        if _pattern_follows(text, match.end()):
            continue
        path = match.group().rstrip(".-")  # a sentence's full stop
        if path.endswith("/.") or "//" in path:
            continue
        if page_folder and text.endswith("](", 0, match.start()):
            path = posixpath.normpath(posixpath.join(page_folder, path))
        found.append((match.start(), Name(path, "path", source, first_line + text.count("\n", 0, match.start()))))
    for match in MODULE.finditer(text):
        name = match.group()
        if name.split(".")[1].split(":")[0] in _NOT_MODULES or _continues_as_file(text, match.end()):
            continue
        found.append((match.start(), Name(name.rstrip("."), "module", source,
                                          first_line + text.count("\n", 0, match.start()))))
    return [name for _, name in sorted(found, key=lambda pair: pair[0])]


def _pattern_follows(text: str, end: int) -> bool:
    return end < len(text) and text[end] in _PATTERN_NEXT


def _continues_as_file(text: str, end: int) -> bool:
    """`stepmill.db-wal`, `stepmill.local/v1`: a file or a host, not a module."""
    return end < len(text) and text[end] in "-/"


def exists(name: Name, root: Path = ROOT) -> bool:
    """Whether the path is in the repository, or the module (and the attribute after it) is stepmill's."""
    if name.kind == "path":
        path, _, test = name.text.partition("::")
        return (root / path).exists() and (not test or _defines(root / path, [test]))
    return _module_exists(name.text, root)


def _module_exists(dotted: str, root: Path) -> bool:
    module, _, attribute = dotted.partition(":")
    parts = module.split(".")
    for package, folder in PACKAGE_FOLDERS:
        prefix = package.split(".")
        if parts[:len(prefix)] == prefix:
            here, rest = root / folder, parts[len(prefix):]
            break
    else:
        return False
    for i, part in enumerate(rest):
        if (here / part).is_dir():
            here = here / part
            continue
        if (here / f"{part}.py").is_file():
            attributes = rest[i + 1:] + ([attribute] if attribute else [])
            return _defines(here / f"{part}.py", attributes)
        # Not a module: an attribute of the package (its __init__.py).
        return _defines(here / "__init__.py", rest[i:] + ([attribute] if attribute else []))
    return _defines(here / "__init__.py", [attribute] if attribute else [])


def _defines(module: Path, attributes: list[str]) -> bool:
    """Whether the module's source defines or imports the first attribute (deeper ones, a class's
    methods, need only appear in it)."""
    if not attributes:
        return True
    if not module.is_file():
        return False
    source = module.read_text(encoding="utf-8")
    first = re.escape(attributes[0])
    defined = re.search(rf"^\s*(?:async\s+def|def|class)\s+{first}\b|^{first}\s*[:=]|^\s*(?:from\s+\S+\s+)?import\b.*\b{first}\b",
                        source, re.M)
    return bool(defined) and all(re.search(rf"\b{re.escape(a)}\b", source) for a in attributes[1:])


def comments_and_docstrings(path: Path) -> list[tuple[str, int]]:
    """A Python file's comments and docstrings, each with its first line; for other files (shell,
    Makefile, TOML, YAML), what follows a `#`."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if not (PATH.search(text) or MODULE.search(text)):
        return []  # nothing to find: spare the parse
    if path.suffix != ".py":
        return [(line[line.index("#"):], n) for n, line in enumerate(text.splitlines(), 1)
                if re.match(r"^#|.*\s#", line)]
    pieces = [(tok.string, tok.start[0]) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
              if tok.type == tokenize.COMMENT]
    statements = [ast.parse(text)]
    while statements:  # statements only: a docstring is never inside an expression
        node = statements.pop()
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                pieces.append((first.value.value, first.lineno))
        statements += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
    return pieces


def documents(root: Path = ROOT) -> list[Path]:
    """The README and the documentation pages."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def code_files(root: Path = ROOT) -> list[Path]:
    """The project's code and build files whose comments may name paths."""
    files = [root / name for name in ("Makefile", "pyproject.toml", "mkdocs.yml") if (root / name).is_file()]
    for folder in TOP_FOLDERS:
        if folder == "docs" or not (root / folder).is_dir():
            continue
        for path in sorted((root / folder).rglob("*")):
            if not path.is_file() or SKIPPED_FOLDERS & set(path.relative_to(root).parts):
                continue
            if path.suffix == ".py" or (folder == ".ci" and path.suffix in ("", ".sh")):
                files.append(path)
    return files


def named(root: Path = ROOT) -> list[Name]:
    """Every path and module name the README, the pages and the code's comments and docstrings name."""
    found = []
    for page in documents(root):
        source = page.relative_to(root).as_posix()
        found += names_in(page.read_text(encoding="utf-8"), source, page_folder=posixpath.dirname(source))
    for path in code_files(root):
        for text, line in comments_and_docstrings(path):
            found += names_in(text, path.relative_to(root).as_posix(), line)
    return found


def missing(root: Path = ROOT) -> list[Name]:
    return [name for name in named(root) if not exists(name, root)]
