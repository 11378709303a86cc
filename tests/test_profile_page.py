"""The profile page (megatron-profile-page; patches/page/) of a saved report, opened from disk in headless Chromium:
no console error, no network request, every part there; its what-if equal to the planner's for random choices,
typed in as a person would and computed by its script; an older report still gets a page saying what it lacks;
bad input one line and exit 2. A launched run's page: tests/test_profile_page_run.py."""
import copy
import json
import random
from pathlib import Path

import pytest

from patches.cli import plan_partition, profile_page
from patches.page import write_profile_page
from patches.page.content import page_content
from patches.partition.plan_lines import plan_line, recompute_what_if_line, what_if_line
from patches.partition.report_plan import PlanRequest, plan_of
from patches.partition.report_recompute import recompute_what_if
from tests.helpers.browser import browser, opened

GOLDEN = Path(__file__).resolve().parent / "data" / "golden" / "fork.report.json"
SECTIONS = ["summary", "read-first", "stages", "memory", "layers", "what-if", "printed"]
CHOICES = 40


@pytest.fixture(scope="module")
def report():
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def chromium():
    with browser() as instance:
        yield instance


@pytest.fixture(scope="module")
def page_file(tmp_path_factory, report):
    path = tmp_path_factory.mktemp("page") / "flops_profile_step2.json"
    path.write_text(json.dumps(report))
    assert profile_page.main([str(path)]) == 0
    return path.with_suffix(".html")


@pytest.fixture(scope="module")
def golden_page(chromium, page_file):
    """The golden report's page, opened once for the tests that only read it or type into it (a load is ~1.5 s)."""
    with opened(chromium, page_file) as opened_page:
        yield opened_page


# each choice's what-if without recompute and with its counts, by the page's own script
PREDICT_BOTH = """choices => { const p = window.profilePage, model = p.pages[0].what_if;
    return choices.map(([parts, counts]) => [p.predictWhatIf(model, parts, null),
                                             p.predictWhatIf(model, parts, counts)]); }"""


# one choice's what-if lines (megatron-plan-partition's), by the page's own script
WHAT_IF_LINES = """([parts, counts]) => { const p = window.profilePage, model = p.pages[0].what_if;
    return p.whatIfLines(model, p.predictWhatIf(model, parts, counts), null); }"""


def page_of(report, tmp_path):
    """The page of this report, written beside it in tmp_path."""
    path = tmp_path / "flops_profile_step2.json"
    path.write_text(json.dumps(report))
    assert profile_page.main([str(path)]) == 0
    return path.with_suffix(".html")


def random_choices(report, count, seed=0):
    """(parts, recompute counts) over the report's layers and stages, every stage non-empty."""
    layers, stages = len(report["layers"]), report["parallelism"]["pipeline_parallel_size"]
    chooser = random.Random(seed)
    choices = []
    for _ in range(count):
        parts = [0] + sorted(chooser.sample(range(1, layers), stages - 1)) + [layers]
        choices.append((parts, [chooser.randint(0, 4) for _ in range(stages)]))
    return choices


def test_the_page_opens_offline_with_every_part(golden_page, page_file):
    page = golden_page.page
    assert golden_page.console_errors == []
    assert golden_page.requests == []
    drawn = page.eval_on_selector_all("article section", "nodes => nodes.map(n => n.className)")
    # the golden report's trace is not beside it: no timeline, and the page says so
    assert drawn == SECTIONS
    assert "missing: timeline: no pipeline_trace_stepN.json beside the report" in page.inner_text(
        "section.read-first")
    assert page.eval_on_selector_all("section.memory .js-plotly-plot", "nodes => nodes.length") == 1
    layers = json.loads(GOLDEN.read_text())["layers"]
    assert page.eval_on_selector_all("section.layers tbody tr", "rows => rows.length") == len(layers)
    page.click("section.layers th:text-is('bwd')")  # sorted by backward time, the largest first
    first = page.eval_on_selector_all("section.layers tbody tr", "rows => rows.map(r => r.cells[0].textContent)")
    assert first == [str(row["index"]) for row in sorted(layers, key=lambda row: -row["bwd_latency_s"])]
    html = page_file.read_text()
    assert "<script src" not in html and "<link" not in html  # everything inside the file


def test_the_what_if_is_the_planners_on_random_choices(golden_page, report):
    choices = random_choices(report, CHOICES)
    computed = golden_page.page.evaluate(PREDICT_BOTH, choices)  # the page's own script, as it loaded
    for (parts, counts), (plain, recomputed) in zip(choices, computed):
        planned = plan_of(report, PlanRequest(parts=parts))
        assert plain["stage_s"] == planned["stage_s"]  # the same floating-point figures, not just close
        assert plain["predicted_iter_s"] == planned["predicted_iter_s"]
        assert plain["predicted_peak_bytes"] == planned["predicted_peak_bytes"]
        what_if = recompute_what_if(report, parts, counts)
        assert recomputed["stage_s"] == what_if["stage_s"]
        assert recomputed["predicted_iter_s"] == what_if["predicted_iter_s"]
        assert recomputed["predicted_change"] == what_if["predicted_change"]
        assert recomputed["predicted_peak_bytes"] == what_if["predicted_peak_bytes"]
        assert recomputed["recompute_priced_from_forward"] == what_if["recompute_priced_from_forward"] == []


def test_a_recompute_the_run_did_not_measure_is_said_as_the_command_says_it(chromium, report, tmp_path):
    """The golden report made to say layers 1 and 3 kept their activations whole: for random choices the page names
    the same layers as priced at their forward as the planner does, in megatron-plan-partition's words."""
    kept = copy.deepcopy(report)
    for row in kept["layers"]:
        if row["index"] in (1, 3):
            row.update(recompute_flops=0, recompute_latency_s=0.0)
    choices = random_choices(kept, 12, seed=4)
    with opened(chromium, page_of(kept, tmp_path)) as page:
        shown = page.page.evaluate("""choices => { const p = window.profilePage, model = p.pages[0].what_if;
            return choices.map(([parts, counts]) => { const result = p.predictWhatIf(model, parts, counts);
                return [result.recompute_priced_from_forward, p.whatIfLines(model, result, null)]; }); }""", choices)
        assert page.console_errors == []
    named = 0
    for (parts, counts), (priced, lines) in zip(choices, shown):
        what_if = recompute_what_if(kept, parts, counts)
        assert priced == what_if["recompute_priced_from_forward"]
        words = next(line for line in lines if line.startswith("iteration "))
        assert recompute_what_if_line(what_if, kept["totals"]["throughput_iter_s"], None).endswith(words)
        named += bool(priced)
    assert named > 0


def test_the_what_if_takes_the_floor_of_cpus_the_ranks_shared(chromium, report, tmp_path):
    """A CPU run whose ranks shared too few CPUs (the plan's basis.shared_cpus): the page's what-if is the planner's
    with the schedule run on the CPUs they share, to the last digit."""
    shared = copy.deepcopy(report)
    shared["partition_plan"]["basis"]["shared_cpus"] = {"cpus": 1, "ranks": 4, "threads": 1, "ranks_per_stage": 2,
                                                        "share": 0.75}
    choices = random_choices(shared, 12, seed=2)
    with opened(chromium, page_of(shared, tmp_path)) as page:
        computed = page.page.evaluate(PREDICT_BOTH, choices)
        lines = page.page.evaluate(WHAT_IF_LINES, choices[0])
        assert page.console_errors == []
    # the floor said in the words of the plan's line: the ranks, their threads, the CPUs, the share they ran
    assert lines[-1] == ("4 ranks of 1 thread on 1 CPUs ran 75% of their compute time, waiting for a core the rest: "
                         "predicted as the schedule runs on those CPUs")
    assert lines[-1] in plan_line(plan_of(shared, PlanRequest()))
    for (parts, counts), (plain, recomputed) in zip(choices, computed):
        assert plain["predicted_iter_s"] == plan_of(shared, PlanRequest(parts=parts))["predicted_iter_s"]
        assert recomputed["predicted_iter_s"] == recompute_what_if(shared, parts, counts)["predicted_iter_s"]
    unshared = plan_of(report, PlanRequest(parts=choices[0][0]))["predicted_iter_s"]
    assert computed[0][0]["predicted_iter_s"] != unshared  # the floor bound here


def test_the_what_if_takes_cpus_that_slowed_each_other(chromium, report, tmp_path):
    """A CPU run whose ranks slowed each other computing at once (basis.shared_cpus.together_rate, stage_shares):
    the page's what-if is the planner's to the last digit, and says so in the plan line's words."""
    slowed = copy.deepcopy(report)
    slowed["partition_plan"]["basis"]["shared_cpus"] = {
        "cpus": 4, "ranks": 4, "threads": 1, "ranks_per_stage": 2, "share": 0.8, "forward_share": 0.4,
        "together_rate": 0.55, "stage_shares": [0.6, 0.9]}
    choices = random_choices(slowed, 12, seed=5)
    with opened(chromium, page_of(slowed, tmp_path)) as page:
        computed = page.page.evaluate(PREDICT_BOTH, choices)
        lines = page.page.evaluate(WHAT_IF_LINES, choices[0])
        assert page.console_errors == []
    assert lines[-1].startswith("4 ranks of 1 thread on 4 CPUs did 80% of their compute time's work at full speed: "
                                "each ran 0.55x its speed alone while all computed (measured)")
    assert lines[-1] in what_if_line(plan_of(slowed, PlanRequest(parts=choices[0][0])))
    for (parts, counts), (plain, recomputed) in zip(choices, computed):
        planned = plan_of(slowed, PlanRequest(parts=parts))
        assert plain["stage_s"] == planned["stage_s"] and plain["predicted_iter_s"] == planned["predicted_iter_s"]
        what_if = recompute_what_if(slowed, parts, counts)
        assert recomputed["stage_s"] == what_if["stage_s"]
        assert recomputed["predicted_iter_s"] == what_if["predicted_iter_s"]


def test_the_what_if_keeps_the_optimizers_floor(chromium, report, tmp_path):
    """A report whose optimizer's own step transient was measured (memory_model's step floor): the page's peaks are
    the planner's to the last byte, and the floor binds (the compute transients taken out so that the step peaks)."""
    floored = copy.deepcopy(report)
    for stage in floored["stages"]:
        stage["memory"]["optimizer_step_transient_bytes"] = stage["memory"]["step_transient_bytes"]
        stage["memory"]["compute_transient_bytes"] = 0
    unfloored = copy.deepcopy(floored)
    for stage in unfloored["stages"]:
        stage["memory"]["optimizer_step_transient_bytes"] = None
    choices = random_choices(floored, 12, seed=3)
    with opened(chromium, page_of(floored, tmp_path)) as page:
        computed = page.page.evaluate(PREDICT_BOTH, choices)
        assert page.console_errors == []
    bound = 0
    for (parts, counts), (plain, recomputed) in zip(choices, computed):
        assert plain["predicted_peak_bytes"] == plan_of(floored, PlanRequest(parts=parts))["predicted_peak_bytes"]
        assert recomputed["predicted_peak_bytes"] == recompute_what_if(floored, parts, counts)["predicted_peak_bytes"]
        bound += plain["predicted_peak_bytes"] != plan_of(unfloored, PlanRequest(parts=parts))["predicted_peak_bytes"]
    assert bound > 0


def test_typed_in_the_page_prints_what_the_command_prints(golden_page, report, capsys):
    """A person types boundaries, recompute counts and a limit; the page's lines are megatron-plan-partition's."""
    page = golden_page.page
    for parts, counts in random_choices(report, 4, seed=1):
        limit_mb = "0.45"
        page.fill("section.what-if input.limit", limit_mb)
        for boundary, value in enumerate(parts[1:-1], start=1):
            page.fill(f"section.what-if input.boundary[data-boundary='{boundary}']", str(value))
        for stage, count in enumerate(counts):
            page.fill(f"section.what-if input.recompute[data-stage='{stage}']", str(count))
        shown = page.inner_text("section.what-if pre.what-if-lines").splitlines()
        assert plan_partition.main([str(GOLDEN), "--parts", ",".join(map(str, parts)), "--recompute",
                                    ",".join(map(str, counts)), "--memory-limit", f"{limit_mb}MB"]) == 0
        printed = capsys.readouterr().out.splitlines()
        assert shown[0] == f"parts [{', '.join(map(str, parts))}], recompute {','.join(map(str, counts))}"
        assert shown[1:3] == printed[:2]  # stage loads and peaks, as printed
        assert printed[2].endswith(shown[3])  # the iteration, and the limit
    assert golden_page.console_errors == []


def test_a_report_without_layers_or_memory_still_gets_a_page(chromium, report, tmp_path):
    older = copy.deepcopy(report)
    for key in ("layers", "partition_plan"):
        older.pop(key)
    for stage in older["stages"]:
        stage.pop("memory")
    path = tmp_path / "flops_profile_step2.json"
    path.write_text(json.dumps(older))
    assert profile_page.main([str(path), "-o", str(tmp_path / "older.html")]) == 0
    with opened(chromium, tmp_path / "older.html") as opened_page:
        assert opened_page.console_errors == [] and opened_page.requests == []
        missing = opened_page.page.inner_text("section.read-first")
        assert "missing: layer table: none in this report" in missing
        assert "missing: memory: this report has no stage memory measured" in missing
        drawn = opened_page.page.eval_on_selector_all("article section", "nodes => nodes.map(n => n.className)")
        assert drawn == ["summary", "read-first", "stages", "printed"]


def test_two_reports_side_by_side(chromium, page_file, tmp_path):
    out = tmp_path / "both.html"
    report = page_file.with_suffix(".json")
    assert profile_page.main([str(report), str(GOLDEN), "-o", str(out)]) == 0
    with opened(chromium, out) as opened_page:
        assert opened_page.console_errors == [] and opened_page.requests == []
        assert opened_page.page.eval_on_selector_all("article", "nodes => nodes.length") == 2
        header = opened_page.page.eval_on_selector_all("section.comparison th",
                                                       "cells => cells.map(c => c.textContent)")
        assert header == ["", str(report), str(GOLDEN)]


@pytest.mark.parametrize("content, says", [
    ("[1, 2]", "is not a profile report of this profiler (no parallelism, totals, stages, step)"),
    ("{not json", "is not the profiler's JSON"),
    ('{"traceEvents": []}', "is not a profile report of this profiler"),
])
def test_a_file_that_is_not_a_report_is_one_line_and_exit_2(tmp_path, capsys, content, says):
    path = tmp_path / "x.json"
    path.write_text(content)
    assert profile_page.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1
    assert not (tmp_path / "x.html").exists()


def test_a_missing_report_or_trace_is_one_line_and_exit_2(tmp_path, capsys):
    assert profile_page.main([str(tmp_path / "none.json")]) == 2
    assert capsys.readouterr().err == f"error: the profile report {tmp_path / 'none.json'} cannot be read: No such " \
                                      "file or directory\n"
    assert profile_page.main([str(GOLDEN), "--trace", str(tmp_path / "t.json"), "-o", str(tmp_path / "p.html")]) == 2
    assert capsys.readouterr().err == f"error: --trace {tmp_path / 't.json'}: no such file\n"


def test_without_plotly_one_line_says_how_to_get_the_page(report, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "plotly.offline", None)  # an import of it fails
    assert profile_page.main([str(GOLDEN), "-o", str(tmp_path / "p.html")]) == 2
    assert capsys.readouterr().err == "error: the profile page needs plotly: pip install plotly (the 'page' extra)\n"
    # a profiled run: one line, the run goes on
    problem = write_profile_page(report, None, str(tmp_path / "p.html"), "p.html")
    assert problem == f"{tmp_path / 'p.html'} not written: the profile page needs plotly: pip install plotly " \
                      "(the 'page' extra)"


def test_the_page_content_is_the_reports(report):
    content = page_content(report, None, "t")
    assert content.summary.iteration_s == report["totals"]["throughput_iter_s"]
    assert [m.predicted_peak_bytes for m in content.memory] == \
        [s["memory"]["predicted_peak_bytes"] for s in report["stages"]]
    for stage, memory in zip(report["stages"], content.memory):  # the parts add up to the predicted peak
        assert sum(memory.parts.values()) == stage["memory"]["predicted_peak_bytes"]
        assert memory.measured_peak_bytes == stage["memory"]["measured_peak_bytes"]
    assert content.what_if["current_parts"] == report["partition_plan"]["current_parts"]
