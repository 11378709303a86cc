"""The patch set stands alone: nothing under patches/ imports our `megatron` (it is one of its users), and the
installed distribution carries `patches` only, so it never shadows a user's own Megatron-DeepSpeed."""
import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def imported_top_level_names(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def test_nothing_under_patches_imports_megatron():
    offenders = sorted(str(path.relative_to(REPO)) for path in (REPO / "patches").rglob("*.py")
                       if "megatron" in set(imported_top_level_names(path)))
    assert offenders == []


def test_the_distribution_installs_patches_only():
    found = re.findall(r"^include = (.*)$", (REPO / "pyproject.toml").read_text(), flags=re.MULTILINE)
    assert found == ['["patches", "patches.*"]']


def _patches_imports(path):
    """The patches modules a file imports (absolute names), at any depth of the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.startswith("patches"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("patches"):
            yield node.module


def _folder_of(module):
    """patches.profiler.report -> 'profiler'; patches (the package) -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (REPO / "patches" / parts[1]).is_dir()) else ""


def test_the_top_of_patches_holds_only_the_public_entry():
    assert sorted(path.name for path in (REPO / "patches").glob("*.py")) == ["__init__.py", "launch.py"]


def test_folders_import_each_other_one_way_and_the_plumbing_none():
    imports = set()
    for path in (REPO / "patches").rglob("*.py"):
        folder = path.relative_to(REPO / "patches").parts[0] if path.parent != REPO / "patches" else ""
        imports |= {(folder, _folder_of(module)) for module in _patches_imports(path)}
    between = {(a, b) for a, b in imports if a and b and a != b}
    assert not {(a, b) for a, b in between if (b, a) in between}, between
    assert not {(a, b) for a, b in between if a in ("process", "formats")}, between
    assert ("partition", "profiler") not in between
