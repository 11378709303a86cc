"""megatron-profile-page REPORT.json [OTHER.json] [-o PAGE.html] [--trace TRACE.json]: a profile as one page that opens
from disk: the summary, the profiled iteration's timeline, every stage's time and memory, the layer table, and a
what-if of another cut (and recompute) by the planner's model. Two reports make one page side by side, like
megatron-compare-profiles.

The timeline comes from the Chrome trace written beside each report (pipeline_trace_stepN.json), or --trace for
the first report. Default output: the first report's name with .html (flops_profile_stepN.html beside it).
Needs plotly (pip install plotly; the 'page' extra).
"""
import argparse
import os
import re
import sys
from typing import List, Optional

from patches.page.content import page_content
from patches.page.render import PageUnavailable, render_page
from patches.partition.report_file import read_json
from patches.process.errors import PatchConfigError

_REQUIRED = ("parallelism", "totals", "stages", "step")


def trace_beside(report_path: str) -> str:
    """pipeline_trace_stepN.json beside flops_profile_stepN.json."""
    directory, name = os.path.split(report_path)
    match = re.fullmatch(r"flops_profile_step(\d+)\.json", name)
    step = match.group(1) if match else "*"
    return os.path.join(directory, f"pipeline_trace_step{step}.json")


def read_profile(path: str) -> dict:
    """A profile report, checked for what every page shows; PatchConfigError, one line, for anything else."""
    report = read_json(path)
    lacking = [key for key in _REQUIRED if not isinstance(report, dict) or key not in report]
    if lacking:
        raise PatchConfigError(f"{path} is not a profile report of this profiler (no {', '.join(lacking)}): give a "
                               "flops_profile_stepN.json")
    return report


def read_trace(path: Optional[str]) -> Optional[dict]:
    """The Chrome trace at `path`, or None where there is none (the page says what is missing)."""
    if path is None or not os.path.exists(path):
        return None
    trace = read_json(path, "the trace")
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise PatchConfigError(f"{path} is not a Chrome trace of this profiler (no traceEvents)")
    return trace


def page_html(report_paths: List[str], trace_path: Optional[str] = None) -> str:
    """The page of these reports (the first one's trace: trace_path, else the one beside it)."""
    contents = []
    for place, path in enumerate(report_paths):
        report = read_profile(path)
        trace = read_trace(trace_path if place == 0 and trace_path else trace_beside(path))
        contents.append(page_content(report, trace, os.path.basename(path) if len(report_paths) == 1 else path))
    return render_page(contents)


def write_page(html: str, path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(html)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-profile-page", description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", metavar="REPORT.json", help="one profile report, or two side by side")
    parser.add_argument("-o", "--output", default=None, help="the page (default: the first report's name, .html)")
    parser.add_argument("--trace", default=None, help="the first report's Chrome trace (default: the one beside it)")
    args = parser.parse_args(argv)
    if len(args.reports) > 2:
        parser.error("one report, or two side by side")
    output = args.output or os.path.splitext(args.reports[0])[0] + ".html"
    try:
        if args.trace is not None and not os.path.exists(args.trace):
            raise PatchConfigError(f"--trace {args.trace}: no such file")
        write_page(page_html(args.reports, args.trace), output)
    except (PatchConfigError, PageUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"error: {output} cannot be written: {error.strerror}", file=sys.stderr)
        return 2
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
