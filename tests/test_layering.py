"""The packages import in one direction: models < data < train < inference (docs/layout.md).

Read with `ast`, not by importing, so function-local imports count too and nothing loads torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["models", "data", "train", "inference"]  # bottom to top: a package may import only those at or below it


def eyas_imports(source: str, package: list[str]) -> list[tuple[int, str, str]]:
    """(line, imported eyas package, the import as written) for each import of `eyas.<pkg>` in `source`, a module
    of `package` (["eyas", "models", "layouts"] for models/layouts/x.py); relative imports are resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            if node.level > len(package):  # climbs above `eyas`: not an eyas import
                continue
            module = base + (node.module.split(".") if node.module else [])
            # `from eyas import data` names the package in the imported names
            names = [module + [a.name] for a in node.names] if module == ["eyas"] else [module]
        else:
            continue
        for name in names:
            if len(name) >= 2 and name[0] == "eyas":
                found.append((node.lineno, name[1], ast.unparse(node)))
    return found


def upward_imports(folder: str, source: str, subpackage: list[str] = []) -> list[str]:
    """The imports in `source`, a module of `folder` (in `subpackage` below it), of a package above `folder`."""
    rank = ORDER.index(folder)
    return [f"line {line}: {text}" for line, pkg, text in eyas_imports(source, ["eyas", folder, *subpackage])
            if pkg in ORDER and ORDER.index(pkg) > rank]


def test_no_package_imports_one_above_it():
    bad, files = [], 0
    for folder in ORDER:
        for path in sorted((ROOT / folder).rglob("*.py")):
            files += 1
            sub = list(path.relative_to(ROOT / folder).parent.parts)
            for hit in upward_imports(folder, path.read_text(), sub):
                bad.append(f"{path.relative_to(ROOT)} {hit}")
    assert files > 40, f"found only {files} files under {ORDER}: is ROOT ({ROOT}) the repository?"
    assert not bad, ("imports against the order " + " < ".join(ORDER) + " (move what both use down):\n  "
                     + "\n  ".join(bad))


def test_the_check_catches_upward_imports():
    # controls that must be flagged: absolute, function-local, relative out of a subpackage, `from eyas import`
    assert upward_imports("data", "from eyas.inference.sampling import choose\n") == [
        "line 1: from eyas.inference.sampling import choose"]
    assert upward_imports("train", "def f():\n    import eyas.inference.cli\n") == ["line 2: import eyas.inference.cli"]
    assert upward_imports("models", "from ...data import chat_template\n", ["layouts"]) == [
        "line 1: from ...data import chat_template"]
    assert upward_imports("models", "from eyas import train\n") == ["line 1: from eyas import train"]
    # and ones that must not be: downward, sideways within the package, relative within it
    assert upward_imports("inference", "from eyas.train.config import load_config\nfrom .tree import DraftTree\n") == []
    assert upward_imports("models", "from ..config import HeadConfig\n", ["layouts"]) == []
    assert upward_imports("data", "from eyas.data.vocab import coverage\nimport torch\n") == []
