"""Compare two FLOPs profile reports of the same model: totals, stages and modules side by side.

    megatron-compare-profiles before.json after.json [--top N] [--json OUT]

delta = B - A, change = delta / A. Totals are listed in a fixed order; stage and module rows are
ordered by the size of their change, largest first (a value that was 0 in A first of all), then by the
size of the delta. Stages are compared when both reports have the same number of them (their memory too, where
both measured it: the state, what a micro-batch in flight keeps, the predicted and the measured peak); modules are
matched by their path in the whole-model tree (global layer indices), so reports of different
pipeline or tensor layouts compare module by module.

Exit status 0 when compared; 2, with one line on stderr, when a file is not a profile report or the
two reports profile different models (different parameter counts or module trees).
"""
import argparse
import json
import math
import sys

from patches.formats.units import bytes_to_string, duration_to_string, flops_rate_to_string, number_to_string


def _fraction(value):
    return f"{100 * value:.2f}%"


# (report key, label, formatter)
TOTAL_METRICS = (
    ("params", "params", number_to_string),
    ("fwd_flops", "fwd flops", number_to_string),
    ("bwd_flops", "bwd flops", number_to_string),
    ("recompute_flops", "recompute flops", number_to_string),
    ("iter_latency_s", "iter latency", duration_to_string),
    ("fwd_latency_s", "fwd latency (bounding stage)", duration_to_string),
    ("bwd_latency_s", "bwd latency (bounding stage)", duration_to_string),
    ("step_latency_s", "step latency (bounding stage)", duration_to_string),
    ("tflops_per_gpu", "hardware FLOPS per GPU", lambda v: flops_rate_to_string(v * 1e12)),
    ("model_tflops_per_gpu", "model FLOPS per GPU", lambda v: flops_rate_to_string(v * 1e12)),
    ("samples_per_s", "samples/s", lambda v: f"{v:.2f}"),
    ("tokens_per_s", "tokens/s", lambda v: f"{v:.1f}"),
    ("mfu", "MFU", _fraction),
)
STAGE_METRICS = (
    ("fwd_flops", "fwd flops", number_to_string),
    ("bwd_flops", "bwd flops", number_to_string),
    ("recompute_flops", "recompute flops", number_to_string),
    ("fwd_latency_s", "fwd latency", duration_to_string),
    ("bwd_latency_s", "bwd latency", duration_to_string),
    ("step_latency_s", "step latency", duration_to_string),
    ("comm_s", "comm+wait", duration_to_string),
    ("train_batch_latency_s", "train_batch", duration_to_string),
    ("tflops_per_gpu", "hardware FLOPS per GPU", lambda v: flops_rate_to_string(v * 1e12)),
    ("idle_fraction", "idle fraction", _fraction),
    ("peak_memory_bytes", "peak memory", number_to_string),
    ("memory_state_bytes", "memory: state", bytes_to_string),
    ("memory_kept_bytes_per_micro_batch", "memory: kept per micro-batch", bytes_to_string),
    ("memory_predicted_peak_bytes", "memory: predicted peak", bytes_to_string),
    ("memory_measured_peak_bytes", "memory: measured peak", bytes_to_string),
)
MODULE_METRICS = (
    ("fwd_flops", "fwd flops", number_to_string),
    ("bwd_flops", "bwd flops", number_to_string),
    ("recompute_flops", "recompute flops", number_to_string),
    ("fwd_latency_s", "fwd latency", duration_to_string),
    ("bwd_latency_s", "bwd latency", duration_to_string),
    ("recompute_latency_s", "recompute latency", duration_to_string),
)


class NotComparable(Exception):
    """The one-line reason two files cannot be compared."""


def load_report(path):
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        raise NotComparable(f"cannot read {path}: {e}") from e
    if not isinstance(report, dict) or report.get("schema_version") not in (1, 2) or "model_tree" not in report:
        # version 2 only adds the straggler view: both compare alike
        raise NotComparable(f"{path} is not a FLOPs profile report (schema_version 1 or 2 with a model_tree)")
    return report


def modules_by_path(tree):
    """{path: node} of the whole-model tree; the root is '' (its type names it)."""
    nodes = {}

    def walk(node, path):
        nodes[path] = node
        for child in node["children"]:
            walk(child, f"{path}.{child['name']}" if path else child["name"])

    walk(tree, "")
    return nodes


def check_same_model(a, b):
    """Raise NotComparable unless both reports profile the same model: same params, same module tree."""
    params_a, params_b = a["totals"]["params"], b["totals"]["params"]
    if params_a != params_b:
        raise NotComparable(f"the reports profile different models: {params_a} params in A, {params_b} in B")
    nodes_a, nodes_b = modules_by_path(a["model_tree"]), modules_by_path(b["model_tree"])
    for path in sorted(set(nodes_a) | set(nodes_b)):
        if path not in nodes_b or path not in nodes_a:
            side = "A" if path in nodes_a else "B"
            raise NotComparable(f"the reports profile different models: module {path!r} is only in {side}")
        shape_a = (nodes_a[path]["type"], nodes_a[path]["params"])
        shape_b = (nodes_b[path]["type"], nodes_b[path]["params"])
        if shape_a != shape_b:
            raise NotComparable(f"the reports profile different models: module {path or '(root)'!r} is "
                                f"{shape_a[0]} with {shape_a[1]} params in A, {shape_b[0]} with {shape_b[1]} in B")


def _row(scope, key, label, fmt, a, b):
    delta = b - a
    change = delta / a if a else (math.inf if delta else 0.0)
    return {"scope": scope, "metric": key, "label": label, "a": a, "b": b, "delta": delta, "change": change,
            "format": fmt}


def _rows(scope, metrics, a, b):
    return [_row(scope, key, label, fmt, a[key], b[key])
            for key, label, fmt in metrics if a.get(key) is not None and b.get(key) is not None]


def _largest_first(rows):
    return sorted(rows, key=lambda r: (-abs(r["change"]), -abs(r["delta"])))


def _stage_values(report):
    idle = {row["stage_id"]: row["idle_fraction"] for row in report["bubble"]["stages"]} if report.get("bubble") else {}
    return [dict(stage, idle_fraction=idle.get(stage["stage_id"]),
                 **{f"memory_{key}": value for key, value in (stage.get("memory") or {}).items()})
            for stage in report["stages"]]


def compare_reports(a, b):
    """{'totals', 'stages', 'modules': [row]} with row = {scope, metric, label, a, b, delta, change, format};
    'stages_note' says why stages were not compared, or is None. Raises NotComparable for different models."""
    check_same_model(a, b)
    totals = _rows("totals", TOTAL_METRICS, a["totals"], b["totals"])
    stages, note = [], None
    if len(a["stages"]) == len(b["stages"]):
        for stage_a, stage_b in zip(_stage_values(a), _stage_values(b)):
            stages += _rows(f"stage {stage_a['stage_id']}", STAGE_METRICS, stage_a, stage_b)
    else:
        note = f"stages not compared: A has {len(a['stages'])} pipeline stages, B has {len(b['stages'])}"
    nodes_a, nodes_b = modules_by_path(a["model_tree"]), modules_by_path(b["model_tree"])
    modules = []
    for path, node in nodes_a.items():
        modules += _rows(path or node["type"], MODULE_METRICS, node, nodes_b[path])
    return {"totals": totals, "stages": _largest_first(stages), "stages_note": note, "modules": _largest_first(modules)}


def _signed(fmt, delta):
    if delta == 0:
        return "0"
    return ("+" if delta > 0 else "-") + fmt(abs(delta))


def _change(row):
    if row["delta"] == 0:
        return "0%"
    if row["change"] == math.inf:
        return "new"
    return f"{100 * row['change']:+.1f}%"


def _table(headers, rows):
    widths = [max(len(str(row[i])) for row in [headers] + rows) for i in range(len(headers))]
    return ["  " + "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [headers] + rows]


def _cells(row, with_scope):
    fmt = row["format"]
    # a change of a fraction is in percentage points
    delta = f"{100 * row['delta']:+.2f} pts" if fmt is _fraction and row["delta"] else _signed(fmt, row["delta"])
    cells = [row["label"], fmt(row["a"]), fmt(row["b"]), delta, _change(row)]
    return [row["scope"]] + cells if with_scope else cells


def _describe(name, path, report):
    par = report["parallelism"]
    device = report.get("device") or {}
    return (f"{name}: {path}: step {report['step']}, pp {par['pipeline_parallel_size']} x tp "
            f"{par['tensor_parallel_size']} x dp {par['data_parallel_size']}, {par['micro_batches']} micro-batches "
            f"of {par['micro_batch_size']}, activation checkpointing "
            f"{'yes' if report['activation_checkpointing'] else 'no'}, "
            f"{device.get('name')} {device.get('dtype')}")


def format_comparison(comparison, a, b, path_a, path_b, top):
    rows = comparison["totals"] + comparison["stages"] + comparison["modules"]
    lines = [_describe("A", path_a, a), _describe("B", path_b, b),
             f"Same model: {number_to_string(a['totals']['params'])} params, "
             f"{len(modules_by_path(a['model_tree']))} modules. delta = B - A, change = delta / A."]
    if all(r["delta"] == 0 for r in rows):
        lines.append("Identical: every compared value is equal.")
    lines += ["", "Totals:"]
    lines += _table(["metric", "A", "B", "delta", "change"], [_cells(r, False) for r in comparison["totals"]])
    lines += ["", "Stages (largest changes first):"]
    if comparison["stages_note"]:
        lines.append(f"  {comparison['stages_note']}")
    else:
        lines += _table(["stage", "metric", "A", "B", "delta", "change"],
                        [_cells(r, True) for r in comparison["stages"]])
    modules = comparison["modules"]
    shown = modules if top <= 0 else modules[:top]
    lines += ["", f"Modules (largest changes first; {len(shown)} of {len(modules)} rows"
                  + ("" if len(shown) == len(modules) else ", --top 0 shows all") + "):"]
    lines += _table(["module", "metric", "A", "B", "delta", "change"], [_cells(r, True) for r in shown])
    return "\n".join(lines) + "\n"


def _json_rows(comparison):
    def plain(row):
        return {k: (None if v == math.inf else v) for k, v in row.items() if k != "format"}

    return {key: [plain(r) for r in comparison[key]] for key in ("totals", "stages", "modules")} | \
        {"stages_note": comparison["stages_note"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description="Compare two FLOPs profile reports of the same model.")
    parser.add_argument("a", help="the first report (A), e.g. before a change")
    parser.add_argument("b", help="the second report (B)")
    parser.add_argument("--top", type=int, default=30, help="module rows to print (0: all; default 30)")
    parser.add_argument("--json", help="also write every row (change null where A is 0 and B is not) to this file")
    args = parser.parse_args(argv)
    try:
        a, b = load_report(args.a), load_report(args.b)
        comparison = compare_reports(a, b)
    except NotComparable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(format_comparison(comparison, a, b, args.a, args.b, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_json_rows(comparison), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
