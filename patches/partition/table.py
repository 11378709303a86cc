"""A report's layer table: every layer of a PipelineModule, on the stage that ran it, with what it took per iteration.

Built from the stages' merged module trees and each stage's layer list (layers.stage_layers, in each rank's
entry): a layer's row is its node of the stage's tree; a tied module used by several layers of one stage is split
evenly among them (no measurement tells them apart: shared_on_one_stage names them, and no plan is made from
them); a plain function layer's work is its stage's own (stage_overheads).
"""
from typing import List, Optional

LATENCY_FIELDS = ("fwd_latency_s", "bwd_latency_s", "recompute_latency_s")


def _find(node, path):
    for name in path.split("."):
        node = next((child for child in node["children"] if child["name"] == name), None)
        if node is None:
            return None
    return node


def layer_table(stages: List[dict], replica: List[dict]) -> Optional[List[dict]]:
    """Every layer of the PipelineModule, in its order: the stage that ran it and what it took, per iteration
    (its node of the stage's tree, merged over tp ranks; a tied module used by several layers of one stage
    split evenly among them; a plain function layer's work is its stage's own). None off a PipelineModule."""
    rows = []
    for stage in stages:
        entry = next((e for e in replica if e["stage_id"] == stage["stage_id"]), None)
        if entry is None or not entry.get("layers"):
            return None
        uses = {}
        for layer in entry["layers"]:
            uses[layer["node"]] = uses.get(layer["node"], 0) + 1
        for layer in entry["layers"]:
            node = _find(stage["modules"], layer["node"]) if layer["node"] else None
            share = 1 / uses[layer["node"]]
            row = {"index": layer["index"], "type": layer["type"], "stage": stage["stage_id"], "node": layer["node"],
                   "params": node["params"] if node else 0}
            for field in LATENCY_FIELDS:
                row[field] = node[field] * share if node else 0.0
            for phase in ("fwd", "bwd", "recompute"):
                row[f"{phase}_flops"] = round(node[f"{phase}_flops"] * share) if node else 0
            rows.append(row)
    return sorted(rows, key=lambda row: row["index"])


def shared_on_one_stage(layers: List[dict]) -> List[List[int]]:
    """Groups of layers that ran one tied module on one stage (a tied embedding and LM head on a single stage):
    its time is split evenly among them in the table, which is no measurement to plan from."""
    by_node = {}
    for row in layers:
        if row.get("node"):
            by_node.setdefault((row["stage"], row["node"]), []).append(row["index"])
    return [sorted(indices) for indices in by_node.values() if len(indices) > 1]


def stage_overheads(stages: List[dict], layers: List[dict]) -> List[float]:
    """Each stage's forward and backward instruction time that none of its layers accounts for (the loss, the
    stage module's own work, function layers), at least 0; the garbage collector's pauses inside those
    instructions are no one's work (the layers' times leave them out too)."""
    return [max(0.0, stage["fwd_latency_s"] + stage["bwd_latency_s"] - _paused_in_compute(stage)
                - sum(layer_seconds(row) for row in layers if row["stage"] == stage["stage_id"]))
            for stage in stages]


def _paused_in_compute(stage: dict) -> float:
    return (stage.get("gc") or {}).get("in_compute_s", 0.0)  # none in a report from before it was measured


def layer_seconds(row: dict) -> float:
    return row["fwd_latency_s"] + row["bwd_latency_s"] + row["recompute_latency_s"]


def parts_from_layers(layers: List[dict]) -> List[int]:
    """The partition that ran, read off the layer table (each stage's first layer)."""
    stages = max(row["stage"] for row in layers) + 1
    return [min(row["index"] for row in layers if row["stage"] == s) for s in range(stages)] + [len(layers)]
