"""The page a launched pp 2 x tp 2 run writes beside its report (--profile-flops-step), opened from disk in
headless Chromium: every part there, no console error, no network request, and the timeline's slices the Chrome
trace's, one for one."""
import pytest

from tests.helpers.browser import browser, opened
from tests.helpers.profiled_runs import profiled_run

SECTIONS = ["summary", "read-first", "timeline", "stages", "memory", "layers", "what-if", "printed"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return profiled_run(tmp_path_factory, "pp2_tp2_checkpointed")


@pytest.mark.launch
def test_the_run_writes_its_page_and_it_shows_the_run_as_traced(run, tmp_path):
    page_path = run.report_path.with_suffix(".html")
    assert page_path.exists(), run.output[-2000:]
    with browser() as chromium, opened(chromium, page_path) as opened_page:
        page = opened_page.page
        assert opened_page.console_errors == [] and opened_page.requests == []
        assert page.eval_on_selector_all("article section", "nodes => nodes.map(n => n.className)") == SECTIONS
        drawn = page.evaluate("""() => document.querySelector('section.timeline .js-plotly-plot').data
            .filter(t => t.mode === 'lines').map(t => ({name: t.name, y: Array.from(t.y), x: Array.from(t.x)}))""")
        for width in (1400, 700):  # for a person to look at; kept out of the repository
            page.set_viewport_size({"width": width, "height": 900})
            page.screenshot(path=str(tmp_path / f"page_{width}.png"), full_page=True)
    events = run.trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"].split(" (")[0] for e in events if e.get("name") == "process_name"}
    expected = sorted((e["args"]["instruction"], f"{names[e['pid']]} · tp {e['tid']}", e["ts"] / 1e3, e["dur"] / 1e3)
                      for e in events if e.get("cat") == "instruction")
    # each slice a segment: (row, start), (row, end), then a gap
    shown = sorted((t["name"], t["y"][i], t["x"][i], t["x"][i + 1] - t["x"][i]) for t in drawn
                   if t["name"] != "recompute (a layer)" for i in range(0, len(t["x"]), 3))
    assert [s[:3] for s in shown] == [e[:3] for e in expected]
    assert [s[3] for s in shown] == pytest.approx([e[3] for e in expected], abs=1e-9)
    recomputed = [e for e in events if e.get("cat") == "module.recompute" and e["args"]["depth"] == 0]
    assert len(recomputed) > 0
    assert sum(len(t["x"]) // 3 for t in drawn if t["name"] == "recompute (a layer)") == len(recomputed)
