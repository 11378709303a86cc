"""The commands only read JSON: each runs in a fresh interpreter without importing torch or DeepSpeed (which
take seconds to import, and DeepSpeed says a line of its own first), and says nothing on stderr but its own words."""
import subprocess
import sys

import pytest

from tests.helpers.golden import GOLDEN
from tests.helpers.launch import bare_env

REPORT = str(GOLDEN / "fork.report.json")

# What the console script does (`from ... import main; sys.exit(main())`), then which heavy packages it imported.
PROGRAM = """
import importlib, sys
code = importlib.import_module(sys.argv[1]).main(sys.argv[2:])
print("imported:", [name for name in ("torch", "deepspeed") if name in sys.modules])
sys.exit(code)
"""


def run_command(module, *argv):
    return subprocess.run([sys.executable, "-c", PROGRAM, module, *map(str, argv)], capture_output=True, text=True,
                          env=bare_env(), timeout=120)


@pytest.mark.parametrize("module, argv", [
    ("patches.cli.plan_partition", [REPORT]),
    ("patches.cli.plan_partition", [REPORT, "--parts", "0,4,7"]),
    ("patches.cli.compare_profiles", [REPORT, REPORT]),
], ids=["plan_partition", "plan_partition_parts", "compare_profiles"])
def test_a_command_imports_no_torch_and_no_deepspeed(module, argv):
    process = run_command(module, *argv)
    assert process.returncode == 0 and process.stderr == "", process.stderr
    assert process.stdout.splitlines()[-1] == "imported: []"


def test_the_plot_imports_matplotlib_but_no_torch(tmp_path):
    process = run_command("patches.cli.plot_profile", REPORT, "-o", tmp_path / "profile.png")
    assert process.returncode == 0 and (tmp_path / "profile.png").exists()
    # The golden report has no trace beside it: the plot's own note is all stderr says.
    assert process.stderr == f"note: no trace at {GOLDEN / 'pipeline_trace_step3.json'}: plotting the stage bars only\n"
    assert process.stdout.splitlines()[-1] == "imported: []"


def test_the_page_imports_plotly_but_no_torch(tmp_path):
    process = run_command("patches.cli.profile_page", REPORT, "-o", tmp_path / "page.html")
    assert process.returncode == 0 and process.stderr == "", process.stderr
    assert process.stdout.splitlines() == [f"wrote {tmp_path / 'page.html'}", "imported: []"]
