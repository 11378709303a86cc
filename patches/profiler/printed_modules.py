"""The report's module sections as text: the Aggregated Profile (the top module types per depth) and the Detailed
Profile (the whole-model tree), in DeepSpeed's flops profiler's layout."""
from patches.formats.text_table import percent
from patches.formats.units import duration_to_string, flops_rate_to_string, number_to_string, params_to_string
from patches.profiler.tree_merge import aggregate_by_depth


def format_aggregated(report: dict, module_depth: int = -1, top_modules: int = 1) -> list:
    """The Aggregated Profile's lines: per depth, the top module types of the whole-model tree."""
    depths = aggregate_by_depth(report["model_tree"])
    last = len(depths) - 1 if module_depth < 0 else min(module_depth, len(depths) - 1)
    lines = [f"Top {top_modules} modules in terms of params, flops (fwd + bwd + recompute) or latency at "
             "different model depths,",
             "each type summed over its modules at that depth in the whole-model tree (all stages, tp shards "
             "summed; latencies the largest tp rank's, summed over stages):"]
    columns = (("params", "params", params_to_string), ("flops", "flops", number_to_string),
               ("fwd latency", "fwd_latency_s", duration_to_string),
               ("bwd latency", "bwd_latency_s", duration_to_string),
               ("recompute latency", "recompute_latency_s", duration_to_string))
    for depth in range(last + 1):
        by_type = depths[depth]
        total = {key: sum(row[key] for row in by_type.values()) for _, key, _ in columns}
        lines.append(f"depth {depth} (all {sum(r['count'] for r in by_type.values())} modules: "
                     + ", ".join(f"{label} {fmt(total[key])}" for label, key, fmt in columns) + "):")
        for label, key, fmt in columns:
            top = sorted(by_type.items(), key=lambda item: item[1][key], reverse=True)[:top_modules]
            lines.append(f"    {label:<17} - {dict((name, fmt(row[key])) for name, row in top)}")
    return lines


def _node_summary(node, root, tp):
    flops = node["fwd_flops"] + node["bwd_flops"] + node["recompute_flops"]
    latency = node["fwd_latency_s"] + node["bwd_latency_s"] + node["recompute_latency_s"]
    root_flops = root["fwd_flops"] + root["bwd_flops"] + root["recompute_flops"]
    return (f"{params_to_string(node['params'])} = {percent(node['params'], root['params'])} Params, "
            f"fwd {number_to_string(node['fwd_flops'])} + bwd {number_to_string(node['bwd_flops'])} + "
            f"recompute {number_to_string(node['recompute_flops'])} flops = {percent(flops, root_flops)} flops, "
            f"fwd {duration_to_string(node['fwd_latency_s'])}, bwd {duration_to_string(node['bwd_latency_s'])}, "
            f"recompute {duration_to_string(node['recompute_latency_s'])}, "
            f"{flops_rate_to_string(flops / tp / latency if latency else 0)}")


def _tree(node, root, tp, depth, module_depth, indent, label):
    shown = node["children"] if module_depth < 0 or depth < module_depth else []
    head = f"{indent}{label}{node['type']}("
    if not shown:
        return [f"{head}{_node_summary(node, root, tp)})"]
    lines = [head, f"{indent}  {_node_summary(node, root, tp)},"]
    for child in shown:
        lines += _tree(child, root, tp, depth + 1, module_depth, indent + "  ", f"({child['name']}): ")
    return lines + [f"{indent})"]


def detailed_tree(report: dict, module_depth: int) -> list:
    tp = report["parallelism"]["tensor_parallel_size"]
    root = report["model_tree"]
    return [
        "Each module profile is listed after its name in the following order:",
        "params = % of model params, fwd + bwd + recompute flops = % of model flops, fwd latency, bwd latency, "
        "recompute latency, FLOPS per GPU = its flops / tp / its (fwd + bwd + recompute) latency",
        "",
        "Note: 1. The tree is the whole model: every stage's modules under one root, layers under their global "
        "index. Params and flops are summed over tp shards (replicated params once); latencies are the largest tp "
        "rank's; a module held by several stages (tied) has its params once and its flops and latencies summed "
        "over stages, as has the root.",
        "2. Params, flops and latencies are inclusive: a module's include its submodules'. Work done outside any "
        "submodule (functional calls, the loss) makes up the difference between a module and the sum of its "
        "submodules.",
        "3. Latencies are device-synchronized, measured on the module itself, forward, backward and recompute apart.",
        "",
    ] + _tree(root, root, tp, 0, module_depth, "", "")
