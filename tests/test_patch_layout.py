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
