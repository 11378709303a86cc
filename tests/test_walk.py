"""docs/architecture.md walks what the code runs: each door profiles one iteration of a real launch under a call
tracer (tests/walk_shim), and the calls that cross between the files of patches/, by the rule of
tests/helpers/call_walk.py, are the page's measured walk, listed and counted. A change that adds a crossing shows
in the page's diff: `PATCHES_WRITE_WALK=1 pytest tests/test_walk.py` writes the page's walk instead of checking
it."""
import difflib
import json

import pytest

from tests.helpers.call_walk import (
    BEGIN,
    CORE_LIMIT,
    DOOR_LIMIT,
    END,
    PAGE,
    RULE,
    WRITE_VARIABLE,
    Door,
    broken_structure,
    crossings,
    page_upstream_block,
    page_walk,
    walk_env,
    walk_section,
    writing,
)
from tests.helpers.flags import PP2, TINY_GPT
from tests.helpers.launch import REPO, TORCHRUN, explain, launch

SCRIPTS = REPO / "tests" / "scripts"
PIPELINE_SECTION = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                    "flops_profiler": {"enabled": True, "profile_step": 2, "module_depth": -1, "top_modules": 1,
                                       "detailed": False}}
ENGINE_SECTION = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                  "steps_per_print": 1000, "flops_profiler": {"enabled": True, "profile_step": 1, "detailed": False}}
USER_CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000}


def _walked(tmp_path_factory, name, script, nprocs, args, config=None):
    directory = tmp_path_factory.mktemp(f"walk_{name}")
    if config is not None:
        (directory / "ds.json").write_text(json.dumps(config))
        args = list(args) + [directory / "ds.json"]
    process = launch(script, nprocs, args, cwd=directory, env=walk_env(directory), via=TORCHRUN)
    assert process.returncode == 0, explain(process)
    assert broken_structure(directory) == [], "the walk's rule is broken (tests/helpers/call_walk.py)"
    return crossings(directory)


@pytest.fixture(scope="module")
def doors(tmp_path_factory):
    """The doors of the page, each one launch, each profiling one iteration."""
    fork = _walked(tmp_path_factory, "fork", REPO / "pretrain_gpt.py", 2, TINY_GPT + PP2 + [
        "--train-iters", "3", "--checkpoint-activations", "--profile-flops-step", "2"])
    section = _walked(tmp_path_factory, "section", SCRIPTS / "plain_pipeline.py", 3, [], PIPELINE_SECTION)
    engine = _walked(tmp_path_factory, "engine", SCRIPTS / "plain_engine.py", 2, [], ENGINE_SECTION)
    user = _walked(tmp_path_factory, "user", SCRIPTS / "user_flops_profiler.py", 2, ["print", "."], USER_CONFIG)
    return [Door("fork", "The fork's `--profile-flops-step`", fork),
            Door("section", "The config section on a `PipelineEngine`", section),
            Door("engine", "The config section on a plain `DeepSpeedEngine`", engine),
            Door("user", "The user's own `FlopsProfiler(model[0])` code (start, train_batch, print, end)", user)]


def measured_walk(doors, upstream_block):
    """The page's walk for these doors; upstream_block: upstream's module launch, as walked where a tree is."""
    return "\n".join([BEGIN, "", RULE, walk_section(doors, ("fork", "section"), upstream_block), END])


@pytest.mark.launch
def test_the_core_stays_small(doors):
    by_key = {door.key: door.crossings for door in doors}
    assert len(by_key["fork"] & by_key["section"]) <= CORE_LIMIT


@pytest.mark.launch
def test_each_door_stays_small(doors):
    """Upstream's module launch is held to the same limit in the upstream tier."""
    assert {door.key: len(door.crossings) for door in doors if len(door.crossings) > DOOR_LIMIT} == {}


@pytest.mark.launch
def test_the_page_walks_what_the_code_runs(doors):
    """Upstream's module launch is walked in the upstream tier (tests/test_upstream_checkout.py): kept as the page
    has it."""
    page, start, end = page_walk()
    walk = measured_walk(doors, page_upstream_block(page[start:end]))
    if writing():
        PAGE.write_text(page[:start] + walk + page[end:])
        return
    diff = "\n".join(difflib.unified_diff(page[start:end].splitlines(), walk.splitlines(), "the page", "the code",
                                          lineterm=""))
    assert page[start:end] == walk, \
        f"docs/architecture.md's walk is not the code's ({WRITE_VARIABLE}=1 writes it):\n{diff}"
