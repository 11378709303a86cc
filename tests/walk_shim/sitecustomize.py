"""Test-only: with $PATCHES_WALK_OUT naming a directory, this process records every call that crosses into a file
of patches/ from another file of patches/ or of the run's own code ($PATCHES_WALK_HOSTS: the folders of the code
that drives the patch set, named relative to $PATCHES_WALK_HOST_ROOT; patches/ itself is never host code), each
(caller file, callee file, callee function, zone) once, in $PATCHES_WALK_OUT/walk.<pid>.json
(tests/helpers/call_walk.py reads them and says the rule).

First on PYTHONPATH for the launches of tests/test_walk.py only; never part of the patch set. A call made while one
of the zones below runs (by code object name in its file) is marked with that zone, so that the reader can leave
it out by the rule's exclusions."""
import json
import os
import sys
import threading

OUT = os.environ.get("PATCHES_WALK_OUT")

if OUT:
    _ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _PATCHES = os.path.join(_ROOT, "patches") + os.sep
    _HOST_ROOT = os.environ.get("PATCHES_WALK_HOST_ROOT", _ROOT)  # host files are named relative to it
    _HOSTS = [os.path.abspath(h) + os.sep for h in os.environ.get("PATCHES_WALK_HOSTS", "").split(os.pathsep) if h]
    # zone name -> (file under patches/, qualified function name): calls made while it runs carry the zone
    _ZONES = {("profiler/report.py", "build_report"): "report composition",
              ("profiler/files.py", "write_json"): "after the printed text",
              ("profiler/files.py", "write_trace"): "after the printed text",
              ("profiler/files.py", "write_tensorboard_scalars"): "after the printed text",
              ("profiler/sources.py", "GatheredReports.trace"): "after the printed text",
              ("profiler/sources.py", "GatheredReports.write"): "after the printed text",
              ("profiler/api.py", "ProfilerAPI.hold"): "after the printed text"}
    _names = {}
    _seen = set()
    _local = threading.local()
    _path = os.path.join(OUT, f"walk.{os.getpid()}.json")

    def _name(filename):
        """('patches', path under patches/) or ('host', path under its host folder) or None."""
        named = _names.get(filename, False)
        if named is False:
            path = os.path.abspath(filename)
            named = None
            if filename.startswith("<"):  # the interpreter's own code (<frozen importlib._bootstrap>, <string>)
                pass
            elif path.startswith(_PATCHES):
                named = ("patches", path[len(_PATCHES):])
            else:
                for host in _HOSTS:
                    if path.startswith(host):
                        named = ("host", os.path.relpath(path, _HOST_ROOT))
                        break
            _names[filename] = named
        return named

    def _write():
        rows = [list(row) for row in sorted(_seen)]
        with open(_path + ".tmp", "w") as out:
            json.dump({"rank": os.environ.get("RANK"), "calls": rows}, out)
        os.replace(_path + ".tmp", _path)

    def _profile(frame, event, arg):
        if event != "call" and event != "return":
            return
        code = frame.f_code
        callee = _name(code.co_filename)
        if callee is None or callee[0] != "patches":
            return
        qualname = getattr(code, "co_qualname", code.co_name)
        zone = _ZONES.get((callee[1], qualname))
        zones = getattr(_local, "zones", None)
        if zones is None:
            zones = _local.zones = []
        if event == "return":
            if zone is not None and zones and zones[-1] == zone:
                zones.pop()
            return
        back = frame.f_back
        caller = _name(back.f_code.co_filename) if back is not None else None
        if caller is not None and caller[1] != callee[1]:
            # a call into a zone's own function carries "entering <zone>", so that the reader can leave out the
            # way into a zone as well as what runs inside it
            where = zones[-1] if zones else (f"entering {zone}" if zone is not None else "")
            if back.f_code.co_name == "<module>":  # a module's own code, run as it is imported
                where = "import"
            row = (caller[0], caller[1], callee[1], qualname, where)
            if row not in _seen:
                _seen.add(row)
                _write()
        if zone is not None:
            zones.append(zone)

    sys.setprofile(_profile)
    threading.setprofile(_profile)

# Another test shim's sitecustomize (only one module of that name is imported): run it here, after the tracer.
if os.environ.get("PATCHES_WALK_CHAIN"):
    import runpy

    runpy.run_path(os.environ["PATCHES_WALK_CHAIN"], run_name="chained_sitecustomize")
