"""The report's module trees: each stage's tree merged over its tensor ranks (FLOPs summed, each latency the slowest
rank's), the stages' trees under one root, and the whole tree aggregated by depth (the printer's aggregated
profile)."""
from typing import List

from patches.profiler.phase_names import phase_fields

# Node fields that are counts (exact ints) and those that are seconds.
FLOP_FIELDS = phase_fields("flops") + phase_fields("other_flops")
CALL_FIELDS = phase_fields("calls")
LATENCY_FIELDS = phase_fields("latency_s")


def clean_node(node: dict) -> dict:
    """A node with every field present, counts as ints and seconds as floats."""
    out = {"name": str(node["name"]), "type": str(node["type"]), "params": int(node["params"]),
           "replicated_params": int(node.get("replicated_params", 0))}
    for field in FLOP_FIELDS + CALL_FIELDS:
        out[field] = int(node.get(field, 0))
    for field in LATENCY_FIELDS:
        out[field] = float(node.get(field, 0.0))
    out["children"] = [clean_node(child) for child in node.get("children", [])]
    return out


def _shape(node):
    return node["name"], node["type"], len(node["children"])


def merge_tp_trees(trees: List[dict]) -> dict:
    """One stage's tree from its tp ranks' trees (same structure on every rank, listed by tp rank).

    Latencies of every node come from one rank per phase, the rank whose whole stage was slowest in
    that phase: taking each node's own maximum could mix ranks and make children outgrow their parent.
    """
    first = trees[0]
    for tree in trees[1:]:
        if _shape(tree) != _shape(first):
            raise ValueError(f"tp ranks disagree on module {first['name']!r}: "
                             f"{tree['name']!r} {tree['type']} with {len(tree['children'])} children vs "
                             f"{first['type']} with {len(first['children'])}")
    slowest = {field: max(range(len(trees)), key=lambda i: trees[i][field]) for field in LATENCY_FIELDS}
    return _merge_tp_nodes(trees, slowest)


def _merge_tp_nodes(trees, slowest):
    first = trees[0]
    replicated = first["replicated_params"]
    merged = {"name": first["name"], "type": first["type"],
              # each rank holds its shard plus a full copy of the replicated part: count that once
              "params": sum(t["params"] - t["replicated_params"] for t in trees) + replicated,
              "replicated_params": replicated}
    for field in FLOP_FIELDS:
        merged[field] = sum(t[field] for t in trees)
    for field in CALL_FIELDS:  # every tp rank runs the module as often: calls are per rank
        merged[field] = max(t[field] for t in trees)
    for field in LATENCY_FIELDS:
        merged[field] = trees[slowest[field]][field]
    merged["children"] = [_merge_tp_nodes([t["children"][i] for t in trees], slowest)
                          for i in range(len(first["children"]))]
    return merged


def _own(node, field):
    """The part of an inclusive count held by the node itself, not by its children."""
    return node[field] - sum(child[field] for child in node["children"])


def _sort_layer_names(children):
    """Put numeric names (global layer indices) in numeric order, in the slots numeric names hold."""
    slots = [i for i, child in enumerate(children) if child["name"].isdigit()]
    layers = sorted((children[i] for i in slots), key=lambda child: int(child["name"]))
    ordered = list(children)
    for slot, layer in zip(slots, layers):
        ordered[slot] = layer
    return ordered


def merge_stage_trees(trees: List[dict]) -> dict:
    """The whole-model tree from the stages' trees, matching children by name.

    A module present on several stages (the root, tied modules) is one node: params once (a node's
    own params, i.e. not in its children, taken once), flops, calls and latencies summed.
    """
    first = trees[0]
    for tree in trees[1:]:
        if tree["type"] != first["type"]:
            raise ValueError(f"stages disagree on module {first['name']!r}: {first['type']} vs {tree['type']}")
    by_name = {}
    for tree in trees:
        for child in tree["children"]:
            by_name.setdefault(child["name"], []).append(child)
    children = _sort_layer_names([merge_stage_trees(group) for group in by_name.values()])
    merged = {"name": first["name"], "type": first["type"]}
    for field in ("params", "replicated_params"):
        merged[field] = max(_own(t, field) for t in trees) + sum(c[field] for c in children)
    for field in FLOP_FIELDS + CALL_FIELDS + LATENCY_FIELDS:
        merged[field] = sum(t[field] for t in trees)
    merged["children"] = children
    return merged


def aggregate_by_depth(tree: dict) -> List[dict]:
    """[{type: {'count', 'params', 'flops', fwd/bwd/recompute latency}} for depth 0, 1, ... deepest].

    Every node of the tree is counted at its own depth, so, the tree being inclusive, a depth's
    params and flops never exceed the depth above.
    """
    depths = []

    def walk(node, depth):
        if depth == len(depths):
            depths.append({})
        row = depths[depth].setdefault(node["type"], {"count": 0, "params": 0, "flops": 0, "fwd_latency_s": 0.0,
                                                       "bwd_latency_s": 0.0, "recompute_latency_s": 0.0})
        row["count"] += 1
        row["params"] += node["params"]
        row["flops"] += node["fwd_flops"] + node["bwd_flops"] + node["recompute_flops"]
        for field in LATENCY_FIELDS:
            row[field] += node[field]
        for child in node["children"]:
            walk(child, depth + 1)

    walk(tree, 0)
    return depths
