"""The profile page: one self-contained HTML file per profile (content.py: what it shows; render.py: the file;
the *.js files: the drawing and the what-if, in the order render.SCRIPTS joins them). megatron-profile-page makes
it from saved reports; a profiled run writes it beside its report.
"""
from typing import Optional

from patches.page.content import page_content
from patches.page.render import PageUnavailable, render_page


def write_profile_page(report: dict, trace: Optional[dict], path: str, title: str) -> Optional[str]:
    """Write the page of `report` (and its trace) to `path`; None where it was written, else one line saying why it
    was not: the page is an extra, and a run goes on without it."""
    try:
        html = render_page([page_content(report, trace, title)])
    except PageUnavailable as error:
        return f"{path} not written: {error}"
    except Exception as error:  # the profiler's failure: a line, never the end of the run
        return f"{path} not written: {type(error).__name__}: {error}"
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(html)
    except OSError as error:
        return f"{path} not written: {error.strerror}"
    return None
