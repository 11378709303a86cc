"""The profiler's internal contracts, read from its source: every public function is typed, and only
layout.py tells a PipelineEngine from a plain DeepSpeedEngine."""
import ast
from pathlib import Path

PROFILER = Path(__file__).resolve().parent.parent / "patches" / "profiler"


def _public_functions(tree):
    """(function node, qualified name) of every function reachable without a leading underscore."""
    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and not child.name.startswith("_"):
                yield from visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if not child.name.startswith("_") or child.name == "__init__":
                    yield child, prefix + child.name
    yield from visit(tree, "")


def _missing_hints(function):
    args = function.args
    named = [a for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
    missing = [a.arg for a in named if a.annotation is None]
    missing += [f"*{a.arg}" for a in (args.vararg, args.kwarg) if a is not None and a.annotation is None]
    if function.returns is None and function.name != "__init__":
        missing.append("return")
    return missing


def test_every_public_function_of_the_profiler_is_typed():
    untyped = []
    for path in sorted(PROFILER.glob("*.py")):
        for function, name in _public_functions(ast.parse(path.read_text())):
            missing = _missing_hints(function)
            if missing:
                untyped.append(f"{path.name}:{function.lineno} {name}: {', '.join(missing)}")
    assert untyped == []


def test_only_the_engine_layout_tells_pipeline_from_plain_engine():
    """isinstance(engine, PipelineEngine) is asked once, in layout.py (runs_a_schedule, which EngineLayout.of
    reads); the rest reads layout.is_pipeline."""
    askers = []
    for path in sorted(PROFILER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                    and any(isinstance(a, ast.Name) and a.id == "PipelineEngine" for a in ast.walk(node))):
                askers.append((path.name, node.lineno))
    assert [name for name, _ in askers] == ["layout.py"], askers
