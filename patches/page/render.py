"""The profile page as one HTML file: its data, its script and styles, and plotly.js, all inside it, so that it opens
from disk with no server and no network request. plotly.js and the data are gzip-compressed and base64-encoded in
it (about 2 MB for the library instead of 4.8), unpacked by the browser's DecompressionStream.

plotly.js comes from the plotly package's own copy (plotly.offline.get_plotlyjs, its public API for offline pages):
an optional dependency, the 'page' extra, like matplotlib for megatron-plot-profile. Without it, PageUnavailable
says in one line how to get the page.
"""
import base64
import gzip
import json
import math
import os
from html import escape
from typing import List

from patches.page.content import PageContent

HERE = os.path.dirname(os.path.abspath(__file__))
# The page's script, one job a file, in the order each needs the ones before it (page.js starts it all).
SCRIPTS = ("units.js", "what_if.js", "elements.js", "timeline.js", "sections.js", "what_if_panel.js", "page.js")
INSTALL_HINT = "pip install plotly (the 'page' extra)"


class PageUnavailable(RuntimeError):
    """The page cannot be drawn here (plotly is not installed): one line, saying how to get it."""


def plotly_js() -> str:
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise PageUnavailable(f"the profile page needs plotly: {INSTALL_HINT}") from None
    return get_plotlyjs()


def _own(name: str) -> str:
    with open(os.path.join(HERE, name)) as f:
        return f.read()


def _packed(text: str) -> str:
    """gzip, then base64: the page's script unpacks it (page.js, `unpacked`); a third of the text's size."""
    return base64.b64encode(gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0)).decode("ascii")


def _finite(value):
    """JSON has no NaN or infinity: a figure that is not finite is drawn as missing (null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _json(contents: List[PageContent]) -> str:
    return json.dumps(_finite([content.as_dict() for content in contents]), separators=(",", ":"), allow_nan=False)


def render_page(contents: List[PageContent]) -> str:
    """One page of one report, or of several side by side (a comparison); PageUnavailable without plotly."""
    library = plotly_js()
    title = " vs ".join(content.title for content in contents)
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        # No request may leave the page: everything it needs is inside it.
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; script-src 'unsafe-inline' "
        "'unsafe-eval'; style-src 'unsafe-inline'; img-src data: blob:; font-src data:\">",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title>",
        f"<style>{_own('page.css')}</style>",
        "</head><body>",
        '<main id="pages"></main>',
        f'<script id="plotly-js" type="application/octet-stream">{_packed(library)}</script>',
        f'<script id="page-data" type="application/octet-stream">{_packed(_json(contents))}</script>',
        "<script>\"use strict\";\n" + "\n".join(_own(name) for name in SCRIPTS) + "</script>",
        "</body></html>",
    ])
