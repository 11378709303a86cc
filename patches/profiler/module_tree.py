"""The profiled module tree: one node per module, holding what every other part measures about it.

- A module reachable twice (a tied or shared submodule) appears once, at its first place; each Parameter
  counts once, in its first owner, as the numel of the local tensor (a tensor-parallel shard counts its shard).
- Modules of the types given as ignore_types (DeepSpeed's ignore_list) are measured like any other but left out
  of what the tree reports: their FLOPs, latencies and params leave their ancestors' totals too.
- Counters are lists indexed by phase (phases.py) and hold each module's own work; `as_dict` makes them
  inclusive. The FLOP counting (flop_counting.py), the hooks (module_hooks.py) and the stack (phase_stack.py)
  write them directly: one node object per module keeps every per-op and per-call update to an attribute read.
- invisible_attention: attention that reaches torch (SDPA, bmm, flash-attn's custom ops) is always counted, so
  an attention module whose forward calls counted no matrix work ran a kernel torch cannot see.
"""
import re
from typing import Iterable, List, Optional, Tuple

import torch

from patches.profiler.module_flops import ModuleFlops, module_flops_for
from patches.profiler.phase_names import PHASE_PREFIXES
from patches.profiler.phases import FORWARD, PHASES

# (module path, module type, depth, phase 'fwd'/'bwd'/'recompute', start, end): one stretch of a module's activity
ModuleEvent = Tuple[str, str, int, str, float, float]
# Module types that compute attention, by name (invisible_attention).
ATTENTION_TYPE = re.compile(r"attn|attention", re.IGNORECASE)


class ModuleNode:
    """One module of the tree and its measurements, per phase. Who writes what: the tree its identity
    (name to ignored); FLOP counting and module formulas `flops` and `other_flops`; the hooks `calls`,
    `input_shapes` and `open_calls`; the phase stack `latency_s` and its bookkeeping (`active`, `since`,
    `wall_since`)."""
    __slots__ = ("name", "path", "type", "params", "children", "ancestors", "ancestor_set", "formula", "ignored",
                 "flops", "other_flops", "latency_s", "calls", "input_shapes", "active", "since", "wall_since",
                 "open_calls")

    def __init__(self, name: str, module_type: str, ancestors: Tuple["ModuleNode", ...],
                 formula: Optional[ModuleFlops]):
        self.name, self.type, self.formula = name, module_type, formula
        self.ancestors = ancestors  # root first
        self.ancestor_set = frozenset(ancestors)
        # dotted names below the root ("3.self_attention"); the root is known by its own name
        self.path = ".".join(a.name for a in ancestors[1:] + (self,)) if ancestors else name
        self.params = 0
        self.ignored = False  # a type in start_profile's ignore_list: measured, left out of the tree
        self.children = []
        self.flops = [0, 0, 0]
        self.other_flops = [0, 0, 0]
        self.latency_s = [0.0, 0.0, 0.0]
        self.calls = [0, 0, 0]
        self.input_shapes = [0, 0, 0]  # per phase, a hash of every call's input tensor shapes, in call order
        self.active = [0, 0, 0]  # entries on the stack, per phase
        self.since = [0.0, 0.0, 0.0]  # the phase clock when the node became active, per phase
        self.wall_since = [0.0, 0.0, 0.0]  # perf_counter when the node became active, per phase
        self.open_calls = []  # forward calls between pre-hook and post-hook

    def shown(self) -> bool:
        """Whether the node is in the reported tree: neither it nor an ancestor is of an ignored type."""
        return not self.ignored and not any(ancestor.ignored for ancestor in self.ancestors)


class ModuleTree:
    """The nodes of `root` and everything below it, and the reported views of their measurements."""

    def __init__(self, root: torch.nn.Module, root_name: str, ignore_types: Optional[Iterable[type]] = ()):
        """ignore_types: exact types, as DeepSpeed matches them; the root is always kept."""
        self.root, self.pairs = _build_tree(root, root_name)  # pairs: [(module, node)], parents first
        self.nodes = tuple(node for _, node in self.pairs)
        ignore_types = tuple(ignore_types or ())
        for module, node in self.pairs:
            node.ignored = node is not self.root and type(module) in ignore_types
        self._node_by_module_id = {id(module): node for module, node in self.pairs}

    def node_of(self, module: torch.nn.Module) -> Optional[ModuleNode]:
        return self._node_by_module_id.get(id(module))

    def as_dict(self) -> dict:
        """The report schema's module node for the root, inclusive, plus *_other_flops and *_calls."""
        return _node_dict(self.root)

    def events(self, stretches: Iterable[Tuple[ModuleNode, int, float, float]]) -> List[ModuleEvent]:
        """The stack's stretches (node, phase, start, end) of the modules shown, as ModuleEvents. The same
        string objects repeat for a module, so pickling the list sends each path once."""
        return [(node.path, node.type, len(node.ancestors), PHASE_PREFIXES[phase], start, end)
                for node, phase, start, end in stretches if node.shown()]

    def zero_counts(self) -> None:
        """Every node's FLOPs, calls, input shapes and latencies back to zero."""
        for node in self.nodes:
            for counter in (node.flops, node.other_flops, node.calls, node.input_shapes):
                counter[:] = [0, 0, 0]
            node.latency_s[:] = [0.0, 0.0, 0.0]

    def adopt_flops(self, counted: "ModuleTree") -> List[str]:
        """Take the FLOPs of `counted`, the same module tree measured in another pass, keeping this tree's
        calls and latencies. Returns "path: phase counted/timed" for each module whose number of calls
        differs, "path: phase input shapes" for the same number with other input shapes."""
        if [module for module, _ in counted.pairs] != [module for module, _ in self.pairs]:
            raise ValueError("adopt_counts: the counting pass profiled another module tree")
        differ = []
        for mine, theirs in zip(self.nodes, counted.nodes):
            mine.flops[:], mine.other_flops[:] = theirs.flops, theirs.other_flops
            for phase, prefix in zip(PHASES, PHASE_PREFIXES):
                if mine.calls[phase] != theirs.calls[phase]:
                    differ.append(f"{mine.path}: {prefix} {theirs.calls[phase]}/{mine.calls[phase]}")
                elif mine.input_shapes[phase] != theirs.input_shapes[phase]:
                    differ.append(f"{mine.path}: {prefix} input shapes")
        return differ

    def invisible_attention(self) -> List[dict]:
        """[{module, type, calls}]: the deepest modules whose type names attention (Attention, Attn) that ran
        forward calls in which no matrix work was counted, in their subtree either (modules left out by
        ignore_list excepted): such a module ran a kernel torch cannot see, and its attention FLOPs are missing."""
        found = []

        def walk(node, ignored_above):
            ignored = ignored_above or node.ignored
            flops, hidden_below = node.flops[FORWARD], False
            for child in node.children:
                child_flops, child_hidden = walk(child, ignored)
                flops, hidden_below = flops + child_flops, hidden_below or child_hidden
            if hidden_below:
                return flops, True
            if not ignored and node.calls[FORWARD] and flops == 0 and ATTENTION_TYPE.search(node.type):
                found.append({"module": node.path, "type": node.type, "calls": node.calls[FORWARD]})
                return flops, True
            return flops, False

        walk(self.root, False)
        return found


def _build_tree(root, root_name):
    """The node tree and (module, node) pairs. A module reachable twice appears once (first place);
    each Parameter counts once, in its first owner, as the numel of the local tensor."""
    pairs, seen_modules, seen_params = [], set(), set()

    def build(module, name, ancestors):
        seen_modules.add(id(module))
        node = ModuleNode(name, type(module).__name__, ancestors, module_flops_for(module))
        pairs.append((module, node))
        own = 0
        for param in module.parameters(recurse=False):
            if id(param) not in seen_params:
                seen_params.add(id(param))
                own += param.numel()
        lineage = ancestors + (node,)
        for child_name, child in module.named_children():
            if id(child) not in seen_modules:
                node.children.append(build(child, child_name, lineage))
        node.params = own + sum(child.params for child in node.children)
        return node

    return build(root, root_name, ()), pairs


def _node_dict(node):
    """The node, inclusive, without its ignored subtrees: their flops, latencies and params leave the
    ancestors' totals too (the work was credited to the ignored nodes, which are simply not added)."""
    kept = [child for child in node.children if not child.ignored]
    children = [_node_dict(child) for child in kept]
    own_params = node.params - sum(child.params for child in node.children)
    out = {"name": node.name, "type": node.type, "params": own_params + sum(child["params"] for child in children)}

    def inclusive(field, own):
        out[field] = own + sum(child[field] for child in children)

    for phase, prefix in zip(PHASES, PHASE_PREFIXES):
        inclusive(f"{prefix}_flops", node.flops[phase])
    for phase, prefix in zip(PHASES, PHASE_PREFIXES):
        out[f"{prefix}_latency_s"] = node.latency_s[phase]  # measured on the node: already inclusive
    for phase, prefix in zip(PHASES, PHASE_PREFIXES):
        inclusive(f"{prefix}_other_flops", node.other_flops[phase])
    for phase, prefix in zip(PHASES, PHASE_PREFIXES):
        out[f"{prefix}_calls"] = node.calls[phase]  # the node's own calls
    out["children"] = children
    return out


def annotate_replicated_params(module: torch.nn.Module, node: dict) -> None:
    """replicated_params: the part of a node's params that every tensor rank holds whole.

    Parameters marked tensor_model_parallel are shards (summed over tensor ranks); the rest
    (LayerNorm, row-parallel biases, position embeddings) are counted once.
    """
    seen = set()

    def visit(mod, tree_node):
        own = 0
        for param in mod.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                if not getattr(param, "tensor_model_parallel", False):
                    own += param.numel()
        children = dict(mod.named_children())
        total = own
        for child_node in tree_node["children"]:
            child = children.get(child_node["name"])
            if child is not None:
                total += visit(child, child_node)
        tree_node["replicated_params"] = total
        return total

    visit(module, node)
