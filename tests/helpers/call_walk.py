"""The walk of docs/architecture.md, measured: which calls cross between the files of patches/ when a door runs.

A launch with `walk_env(directory, hosts)` records every call into a file of patches/ (tests/walk_shim); `crossings`
reads what every process of it recorded and keeps what the rule below counts; `walk_section` writes the doors'
crossings as the page shows them.
"""
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, FrozenSet, Iterable, List, Optional, Tuple

from tests.helpers.launch import REPO

SHIM = REPO / "tests" / "walk_shim"
PAGE = REPO / "docs" / "architecture.md"
BEGIN = "<!-- The measured walk: tests/test_walk.py writes everything from here to the end mark. -->"
END = "<!-- End of the measured walk. -->"
# Set to 1, the walk tests write the page's walk instead of checking it.
WRITE_VARIABLE = "PATCHES_WRITE_WALK"

RULE = """\
A crossing is a call from one component of `patches/` to another, or from the door's own code (the training loop
or script that drives the patch set) into `patches/`; each (caller file, callee function) once, over the whole run,
every rank. A component is a folder of `patches/` (`to_deepspeed/`, `to_megatron/`, `partition/`, `process/`,
`formats/`, `cli/`), the top level's public entry (`__init__.py`, `launch.py`), or one of the parts of
`profiler/` below (its facade first); each file of `profiler/` not named there is a component of its own. A part is
called from outside only through its facade (checked: a call past it fails the test); calls between its own files
are its business, not the walk's.
{parts}
Not counted:
- calls into the leaf helpers, which call nothing else in `patches/` (checked): {leaves};
- what the interpreter, torch and DeepSpeed call by their own design: the callbacks the patch set hands them (the
  instruction map's entries, module and autograd hooks), called from their code, and the callbacks that land on
  whatever frame is running (the dispatch mode's `__torch_dispatch__`, the garbage collector's callback, a
  storage's finalizer);
- a module's own code run as it is imported (`<module>`), and what it calls;
- a data object's conversions of itself (`as_dict`, `from_entry`, `to_bytes`, `from_bytes`);
- the report's composition inside `report.build_report` (a pure function of the entries and the context);
- what comes after the printed text (the files, the trace, TensorBoard, the report held for `engine.flops_profiler`),
  and the calls into it.
"""


@dataclass(frozen=True)
class Part:
    """Files of profiler/ that the walk counts as one component: called from outside only through `facade`."""
    title: str
    facade: Tuple[str, ...]
    behind: Tuple[str, ...]

    def files(self) -> Tuple[str, ...]:
        return self.facade + self.behind

    def line(self) -> str:
        facade = ", ".join(f"`{name[len('profiler/'):]}`" for name in self.facade)
        if not self.behind:
            return f"- {self.title}: {facade}, each called from outside;"
        behind = ", ".join(f"`{name[len('profiler/'):]}`" for name in self.behind)
        return f"- {self.title}: {facade}, and behind it {behind};"


def _profiler(*names: str) -> Tuple[str, ...]:
    return tuple(f"profiler/{name}.py" for name in names)


PARTS = (
    Part("the stage measurement", _profiler("measurement"), _profiler(
        "engine_hooks", "memory", "memory_terms", "allocator_trace", "held_state", "kept_activations",
        "module_profiler", "module_tree", "module_hooks", "flop_counting", "flop_formulas", "module_flops",
        "phase_stack", "phases", "gc_pauses", "where_it_ran")),
    Part("the report", _profiler("sources", "local_sources", "printer", "files"), _profiler(
        "gather", "host_contention", "context", "report", "tree_merge", "trace", "entry", "notes", "peaks",
        "store_exchange", "stragglers", "memory_report", "report_stages", "report_timing", "report_replica",
        "printed_stages", "printed_modules", "shared_cpus")),
    Part("the schedule", _profiler("one_step"), _profiler("iteration_clock")),
    Part("the user's profiler", _profiler("api", "user_code_profiler", "pipeline_profiler"), ()),
)
LEAVES = ("formats/units.py", "formats/text_table.py", "process/store.py", "process/errors.py",
          "profiler/fail_safe.py", "profiler/shadowing.py", "profiler/numbering.py")
RULE = RULE.format(parts="\n".join(part.line() for part in PARTS),
                   leaves=", ".join(f"`{leaf}`" for leaf in LEAVES))

# Callbacks that land on whatever Python frame is running when torch or the interpreter calls them.
_LANDING_CALLBACKS = {("profiler/flop_counting.py", "FlopCountingMode.__torch_dispatch__"),
                      ("profiler/flop_counting.py", "FlopCountingMode._should_skip_dynamo"),
                      ("profiler/gc_pauses.py", "GcPauses._on_collection"),
                      ("profiler/allocator_trace.py", "_mark_unseen_free")}
_CONVERSIONS = {"as_dict", "from_entry", "to_bytes", "from_bytes"}
_ZONES_LEFT_OUT = {"report composition", "after the printed text", "entering after the printed text", "import"}
_PART_OF = {name: part for part in PARTS for name in part.files()}


def component(file: str) -> str:
    """The component a file of patches/ belongs to, by name."""
    if file in _PART_OF:
        return _PART_OF[file].title
    if "/" not in file:
        return "the public entry"
    folder, _ = file.split("/", 1)
    return file if folder == "profiler" else f"{folder}/"


# The folders of this repository's own code that drives the patch set: our GPT, the tests' scripts and their helpers.
FORK_HOSTS = (REPO / "megatron", REPO / "tests" / "scripts", REPO / "tests" / "helpers")


def walk_env(directory: Path, hosts: Iterable[Path] = FORK_HOSTS, root: Path = REPO,
             python_path: Iterable[Path] = (REPO,), chain: Optional[Path] = None) -> Dict[str, str]:
    """The environment that makes a launch record its calls into `directory`; hosts: the folders of the door's own
    code (its calls into patches/ count; the installed libraries' never do), named relative to `root`;
    python_path: after the tracer's shim; chain: another shim's sitecustomize.py, run after the tracer starts."""
    env = {"PATCHES_WALK_OUT": str(directory), "PATCHES_WALK_HOSTS": os.pathsep.join(str(h) for h in hosts),
           "PATCHES_WALK_HOST_ROOT": str(root), "PYTHONPATH": os.pathsep.join(map(str, [SHIM, *python_path]))}
    if chain is not None:
        env["PATCHES_WALK_CHAIN"] = str(chain)
    return env


@dataclass(frozen=True, order=True)
class Crossing:
    caller: str  # a file of patches/ ("profiler/one_step.py"), or of the door's own code ("megatron/training.py")
    callee: str  # "profiler/measurement.py:StageMeasurement.begin"
    from_host: bool  # the caller is the door's own code

    def line(self) -> str:
        caller = self.caller if self.from_host else f"patches/{self.caller}"
        return f"`{caller}` -> `patches/{self.callee}`"


def _counted(kind: str, caller: str, callee_file: str, function: str, zone: str) -> bool:
    if (callee_file, function) in _LANDING_CALLBACKS or zone in _ZONES_LEFT_OUT or callee_file in LEAVES:
        return False
    if kind == "patches" and component(caller) == component(callee_file):
        return False
    if function == "<module>" or function.rsplit(".", 1)[-1] in _CONVERSIONS:
        return False
    return True


def _records(directory: Path):
    for path in Path(directory).glob("walk.*.json"):
        yield from json.loads(path.read_text())["calls"]


def crossings(directory: Path) -> FrozenSet[Crossing]:
    """What the rule counts of every process's record in `directory`."""
    return frozenset(Crossing(caller, f"{callee_file}:{function}", kind == "host")
                     for kind, caller, callee_file, function, zone in _records(directory)
                     if _counted(kind, caller, callee_file, function, zone))


def broken_structure(directory: Path) -> List[str]:
    """What the rule's structure forbids, in every process's record: a call past a part's facade, a leaf helper
    calling another file of patches/ (a landing callback runs from wherever it lands, and is not a call)."""
    broken = set()
    for kind, caller, callee_file, function, zone in _records(directory):
        if (callee_file, function) in _LANDING_CALLBACKS or function == "<module>" or zone == "import":
            continue
        part = _PART_OF.get(callee_file)
        if part is not None and callee_file not in part.facade and (kind == "host" or _PART_OF.get(caller) != part):
            broken.add(f"{caller} calls {callee_file}:{function}, past the facade of {part.title}")
        if kind == "patches" and caller in LEAVES:
            broken.add(f"the leaf helper {caller} calls {callee_file}:{function}")
    return sorted(broken)


@dataclass(frozen=True)
class Door:
    key: str  # the page's name for it, in its heading
    title: str
    crossings: FrozenSet[Crossing]


CORE_LIMIT = 18  # the crossings every door makes: what a newcomer reads first
DOOR_LIMIT = 30  # one door's crossings, its own and the core's: what a maintainer follows for one way in

CORE_HEADING = "**The shared core**"
UPSTREAM_BEGIN = "<!-- Upstream's module launch: walked in the upstream tier (tests/test_upstream_checkout.py). -->"
UPSTREAM_END = "<!-- End of upstream's module launch. -->"


def walk_section(doors: List[Door], core_of: Tuple[str, ...], upstream_block: str = "") -> str:
    """The page's measured walk: the core (the crossings every door of `core_of` makes), then each door's own, and
    upstream's module launch (`upstream_block`, door_block's, walked where an upstream tree is) after the first."""
    by_key = {door.key: door for door in doors}
    core = frozenset.intersection(*(by_key[key].crossings for key in core_of))
    titles = "; ".join(by_key[key].title for key in core_of)
    lines = [f"{CORE_HEADING}, the crossings each of these doors makes ({titles}): {len(core)}", ""]
    lines += [f"- {crossing.line()}" for crossing in sorted(core)]
    blocks = [door_block(door, {crossing.line() for crossing in core}) for door in doors]
    blocks.insert(1, "\n".join([UPSTREAM_BEGIN, upstream_block.strip("\n"), UPSTREAM_END]))
    return "\n".join(lines) + "\n\n" + "\n\n".join(blocks) + "\n"


def door_block(door: Door, core_lines: set) -> str:
    """One door's crossings beyond the core (core_lines: the core's, as Crossing.line writes them)."""
    lines = {crossing.line() for crossing in door.crossings}
    own = sorted(lines - core_lines)
    shared = len(lines & core_lines)
    return "\n".join([f"**{door.title}**: {len(own)} of its own + {shared} of the core = {len(lines)}", ""]
                     + [f"- {line}" for line in own])


def page_walk() -> Tuple[str, int, int]:
    """(the page, where its measured walk starts, where it ends)."""
    page = PAGE.read_text()
    return page, page.index(BEGIN), page.index(END) + len(END)


def writing() -> bool:
    return os.environ.get(WRITE_VARIABLE) == "1"


def page_core(walk: str) -> set:
    """The core's lines in the page's measured walk."""
    block = walk[walk.index(CORE_HEADING):].split("\n\n")[1]
    return {line[2:] for line in block.splitlines()}


def page_upstream_block(walk: str) -> str:
    """What the page's walk holds between the upstream marks ("" where it has none)."""
    if UPSTREAM_BEGIN not in walk:
        return ""
    return walk[walk.index(UPSTREAM_BEGIN) + len(UPSTREAM_BEGIN):walk.index(UPSTREAM_END)].strip("\n")


def with_upstream_block(walk: str, block: str) -> str:
    """The page's walk with `block` between the upstream marks."""
    start, end = walk.index(UPSTREAM_BEGIN) + len(UPSTREAM_BEGIN), walk.index(UPSTREAM_END)
    return walk[:start] + "\n" + block.strip("\n") + "\n" + walk[end:]
