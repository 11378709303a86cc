"""The report's memory: each stage's `memory` and each layer's `activation_bytes` and `state_bytes`, from the
ranks' measurements (memory.StageMemory, in their entries). Per GPU: of a stage's tensor ranks, the one whose
predicted peak is the largest (the one a memory limit binds) gives the stage's figures and its layers'.
The predicted peak is partition/memory_model.py's, for the layers the stage holds."""
from typing import Dict, List, Optional, Tuple

from patches.partition.memory_model import PositionMemory, stage_peak
from patches.profiler.fail_safe import MEMORY


def stage_memory(entry: dict, iteration: int) -> Optional[dict]:
    """The stage memory of one rank's entry (None where it measured none); iteration: the one it was measured in."""
    measured = entry.get("memory")
    if measured is None:
        return None
    layer_activation = sum(size for _, size in measured["layer_activation_bytes"])
    memory = {
        "global_rank": int(entry["global_rank"]),
        "iteration": int(iteration),
        "basis": measured["basis"],
        "not_read": measured["not_read"],
        "param_bytes": measured["param_bytes"],
        "grad_bytes": measured["grad_bytes"],
        "optimizer_bytes": measured["optimizer_bytes"],
        "state_bytes": measured["state_bytes"],
        "optimizer_created_bytes": measured["optimizer_created_bytes"],
        "fixed_buffer_bytes": measured.get("fixed_buffer_bytes", 0),  # 0 in an entry from before it was measured
        "layer_activation_bytes": layer_activation,
        "micro_batches": measured["micro_batches"],
    }
    allocator = measured["allocator"]
    if allocator is None:
        return dict(memory, **{field: None for field in _ALLOCATOR_FIELDS})
    position = PositionMemory(allocator["base_bytes"], allocator["kept_bytes_per_micro_batch"] - layer_activation,
                              allocator["in_flight_micro_batches"], allocator["compute_transient_bytes"],
                              allocator["step_transient_bytes"], measured["state_bytes"], memory["fixed_buffer_bytes"])
    peak = stage_peak(measured["state_bytes"], layer_activation, position)
    return dict(memory,
                start_bytes=allocator["start_bytes"],
                end_bytes=allocator["end_bytes"],
                base_bytes=position.base_bytes,
                kept_bytes_per_micro_batch=allocator["kept_bytes_per_micro_batch"],
                outside_layers_bytes=position.outside_layers_bytes,
                in_flight_micro_batches=position.in_flight_micro_batches,
                compute_transient_bytes=position.compute_transient_bytes,
                step_transient_bytes=position.step_transient_bytes,
                # None in an entry from before it was measured
                optimizer_step_transient_bytes=allocator.get("optimizer_step_transient_bytes"),
                compute_peak_bytes=peak.compute_peak_bytes,
                step_peak_bytes=peak.step_peak_bytes,
                predicted_peak_bytes=peak.predicted_peak_bytes,
                measured_peak_bytes=allocator["measured_peak_bytes"],
                measured_peak_instruction=allocator["measured_peak_instruction"],
                unseen_free_bytes=allocator["unseen_free_bytes"])


_ALLOCATOR_FIELDS = ("start_bytes", "end_bytes", "base_bytes", "kept_bytes_per_micro_batch", "outside_layers_bytes",
                     "in_flight_micro_batches", "compute_transient_bytes", "step_transient_bytes",
                     "optimizer_step_transient_bytes", "compute_peak_bytes",
                     "step_peak_bytes", "predicted_peak_bytes", "measured_peak_bytes", "measured_peak_instruction",
                     "unseen_free_bytes")


def per_gpu(entries: List[dict], step: int) -> Optional[Tuple[dict, dict]]:
    """(the stage's memory, the entry it came from): of the stage's tensor ranks, the largest predicted peak (or
    state, where the allocator was not read); None where none measured memory, or one's measurement failed
    (fail_safe.py: the report names it). step: the profiled iteration (the
    memory was measured in the one that counted the FLOPs, the entry's counted_iteration, else in it)."""
    if any(fault["part"] == MEMORY for entry in entries for fault in entry.get("faults") or ()):
        return None  # a tensor rank whose measurement failed may hold the most: no figure stands for the stage
    candidates = [(memory, entry) for entry in entries
                  for memory in [stage_memory(entry, entry.get("counted_iteration") or step)] if memory is not None]
    if not candidates:
        return None
    return max(candidates, key=lambda pair: (pair[0]["predicted_peak_bytes"] or 0, pair[0]["state_bytes"],
                                             -pair[1]["global_rank"]))


def add_layer_memory(layers: Optional[List[dict]], chosen: Dict[int, dict]) -> None:
    """Each layer row's activation_bytes (what it kept, as it ran) and state_bytes, and its activations both ways:
    kept_whole_bytes (run plainly: what it kept; recomputed: what its recompute saved) and kept_as_checkpoint_bytes
    (recomputed: what it kept, its input; run plainly: what its forward was called with), and its largest
    parameter's bytes (largest_param_bytes), from the entry that gave its stage's memory (chosen: stage id ->
    entry); null where its stage measured none (the two ways and the largest parameter also where the entry is from
    before they were measured)."""
    for row in layers or ():
        measured = (chosen.get(row["stage"]) or {}).get("memory")
        pairs = {name: dict(map(tuple, measured.get(name) or ())) if measured else {}
                 for name in ("layer_activation_bytes", "layer_state_bytes", "layer_recompute_bytes",
                              "layer_input_bytes", "layer_largest_param_bytes")}
        kept = pairs["layer_activation_bytes"].get(row["index"], 0)
        row["activation_bytes"] = kept if measured else None
        row["state_bytes"] = pairs["layer_state_bytes"].get(row["index"], 0) if measured else None
        both_ways = measured is not None and "layer_input_bytes" in measured
        recomputed = row["index"] in pairs["layer_recompute_bytes"]
        row["kept_whole_bytes"] = (pairs["layer_recompute_bytes"][row["index"]] if recomputed else kept) \
            if both_ways else None
        row["kept_as_checkpoint_bytes"] = (kept if recomputed else pairs["layer_input_bytes"].get(row["index"], 0)) \
            if both_ways else None
        row["largest_param_bytes"] = pairs["layer_largest_param_bytes"].get(row["index"], 0) \
            if measured is not None and "layer_largest_param_bytes" in measured else None
