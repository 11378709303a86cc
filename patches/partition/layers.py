"""A PipelineModule's layer list as the report names it: each layer's index, type, and the node of the stage's
module tree that holds its work (none for a plain function layer).

DeepSpeed builds each LayerSpec (or module) of the list into a submodule named by its global index, each
TiedLayerSpec into tied_modules[key] (one module for every use of the key on a stage), and calls a plain
function as it is. Private names of PipelineModule read here: _layer_specs and parts (requires()).
"""
from typing import List, Optional

import torch
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec


def requires() -> list:
    return [(PipelineModule, "_partition_layers"), (PipelineModule, "_set_bounds")]


def layer_type(spec: object) -> str:
    """What the report calls a layer: its class's name (a plain function's name)."""
    if isinstance(spec, LayerSpec):  # TiedLayerSpec too
        return spec.typename.__name__
    if isinstance(spec, torch.nn.Module):
        return type(spec).__name__
    return getattr(spec, "__name__", type(spec).__name__)


def layer_types(module: PipelineModule) -> List[str]:
    """Every layer's type, in the PipelineModule's order: what a partition planned for it must match."""
    return [layer_type(spec) for spec in module._layer_specs]


def stage_layers(module: torch.nn.Module, stage: int) -> Optional[List[dict]]:
    """[{index, type, node}] of the layers `stage` holds, node being the path of its work in the stage's module
    tree ("3", "tied_modules.embed") or None for a plain function; None for a module that is no PipelineModule."""
    specs, parts = getattr(module, "_layer_specs", None), getattr(module, "parts", None)
    if specs is None or parts is None:
        return None
    layers = []
    for index in range(parts[stage], parts[stage + 1]):
        spec = specs[index]
        if isinstance(spec, TiedLayerSpec):
            node = f"tied_modules.{spec.key}"
        elif isinstance(spec, (LayerSpec, torch.nn.Module)):
            node = str(index)
        else:
            node = None
        layers.append({"index": index, "type": layer_type(spec), "node": node})
    return layers
