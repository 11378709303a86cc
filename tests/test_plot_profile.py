"""tools/plot_profile.py on the report and trace of a real pp=2 x tp=2 run: the PNG is written, shows
both stages and every track, and is not blank."""
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image
from matplotlib.colors import to_rgb

from tests.helpers.launch import load_tool
from tests.helpers.profiled_runs import profiled_run

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "plot_profile.py"




@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return profiled_run(tmp_path_factory, "pp2_tp2_checkpointed")


@pytest.mark.launch
def test_png_written_and_not_blank(run, tmp_path):
    out = tmp_path / "profile.png"
    process = subprocess.run([sys.executable, str(TOOL), str(run.report_path), "-o", str(out)],
                             capture_output=True, text=True)
    assert process.returncode == 0, process.stderr
    assert process.stdout.strip() == f"wrote {out}"
    pixels = image.imread(str(out))[..., :3]
    assert pixels.shape == (990, 1430, 3)  # 13 x 9 inches at 110 dpi
    assert pixels.std() > 0.1
    rgb = np.round(pixels * 255).astype(int).reshape(-1, 3)
    colours, counts = np.unique(rgb, axis=0, return_counts=True)
    assert len(colours) > 50
    present = {tuple(c): n for c, n in zip(colours.tolist(), counts)}
    for part, colour in load_tool("plot_profile").PARTS:  # every part of the stacked bars and the Gantt, as solid fills
        assert present.get(tuple(round(255 * x) for x in to_rgb(colour)), 0) > 50, part


@pytest.mark.launch
def test_figure_has_every_stage_and_track_with_units(run):
    tool = load_tool("plot_profile")
    report = run.report
    figure = tool.plot_profile(report, run.trace)
    bars, gantt = figure.axes[:2]
    assert [t.get_text() for t in bars.get_xticklabels()] == ["stage 0\nranks 0,1", "stage 1\nranks 2,3"]
    assert bars.get_ylabel() == "time in the profiled iteration (ms)"
    rows = [t.get_text() for t in gantt.get_yticklabels()]
    assert rows == ["stage 0 tp 0", "stage 0 tp 1", "stage 1 tp 0", "stage 1 tp 1"]
    assert gantt.get_xlabel().startswith("time (ms")
    # the stacked bars are the stage's parts, which add up to all its instructions plus the untimed rest
    parts = [label for label, _ in tool.PARTS]
    heights = {c.get_label(): [p.get_height() for p in c.patches] for c in bars.containers}
    assert list(heights) == parts
    for i, stage in enumerate(report["stages"]):
        expected = tool.stage_parts(stage)
        assert [heights[part][i] for part in parts] == pytest.approx([expected[part] * 1e3 for part in parts])
        assert sum(expected.values()) == pytest.approx(stage["instructions_s"] + stage["other_s"])
        assert expected["recompute"] == stage["modules"]["recompute_latency_s"] > 0


@pytest.mark.launch
def test_without_a_trace_the_bars_alone(run, tmp_path):
    report = tmp_path / "flops_profile_step2.json"
    shutil.copy(run.report_path, report)
    out = tmp_path / "bars.png"
    process = subprocess.run([sys.executable, str(TOOL), str(report), "-o", str(out)], capture_output=True, text=True)
    assert process.returncode == 0, process.stderr
    assert f"note: no trace at {tmp_path / 'pipeline_trace_step2.json'}: plotting the stage bars only" in process.stderr
    assert image.imread(str(out)).shape[:2] == (550, 1430)
    missing = subprocess.run(
        [sys.executable, str(TOOL), str(report), "-o", str(out), "--trace", str(tmp_path / "x.json")],
        capture_output=True, text=True)
    assert missing.returncode == 2 and "no trace at" in missing.stderr
