"""ModuleProfiler on CPU: exact FLOPs per module and phase, nested latencies, no effect on numerics."""
import copy
import functools
import gc
import json
import time
import warnings
import weakref
from pathlib import Path

import jsonschema
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from torch.utils.flop_counter import FlopCounterMode

import patches.profiler
from patches.profiler import flop_formulas
from patches.profiler.module_flops import register_module_flops
from patches.profiler.module_profiler import ModuleProfiler

B, S, H, HEADS, LAYERS, VOCAB = 2, 8, 16, 2, 2, 32
LAYER_GEMM_FWD = 24 * B * S * H * H  # qkv 6, proj 2, fc1 8, fc2 8 (x B s h^2)
ATTENTION_FWD = 4 * B * S * S * H  # Q K^T and P V, dense
LAYER_FWD = LAYER_GEMM_FWD + ATTENTION_FWD
# Every GEMM twice (input and weight gradients); CPU flash attention backward runs 5 GEMMs, 2.5x forward.
LAYER_BWD = 2 * LAYER_GEMM_FWD + 10 * B * S * S * H
FC2_FWD = 8 * B * S * H * H
HEAD_FWD = 2 * B * S * H * VOCAB
LAYER_NORM_OTHER = 7 * B * S * H  # module_flops.layer_norm_flops with an affine transform
CHECKPOINT_MODES = [None, "torch_reentrant", "torch_non_reentrant", "deepspeed"]


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)
        self.proj = nn.Linear(H, H)

    def forward(self, x):
        q, k, v = (t.view(B, S, HEADS, H // HEADS).transpose(1, 2) for t in self.qkv(x).split(H, dim=-1))
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(context.transpose(1, 2).reshape(B, S, H))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(H, 4 * H)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * H, H)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, hidden_dropout=0.0):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(H), Attention(), nn.LayerNorm(H), MLP()
        self.hidden_dropout = hidden_dropout

    def forward(self, x):
        x = x + F.dropout(self.attn(self.ln1(x)), self.hidden_dropout, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), self.hidden_dropout, self.training)


def lm_head(embedding, hidden):
    """The LM head reusing the embedding's weight, as DeepSpeed's TiedLayerSpec(forward_fn=...) calls it."""
    return F.linear(hidden, embedding.weight)


def run_layer(mode, layer, x):
    if mode is None:
        return layer(x)
    if mode == "torch_reentrant":
        return torch_checkpoint.checkpoint(layer, x, use_reentrant=True)
    if mode == "torch_non_reentrant":
        return torch_checkpoint.checkpoint(layer, x, use_reentrant=False)
    return ds_checkpointing.checkpoint(layer, x)  # what PipelineModule uses


class TinyGPT(nn.Module):
    def __init__(self, checkpoint=None, hidden_dropout=0.0):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(Block(hidden_dropout) for _ in range(LAYERS))
        self.checkpoint = checkpoint
        self.head = functools.partial(lm_head, self.embed)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = run_layer(self.checkpoint, layer, x)
        return self.head(x)


def make_batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, S), generator=generator)
    return ids, torch.randint(0, VOCAB, (B * S,), generator=generator)


def train_step(model, ids, targets):
    torch.manual_seed(7)  # same dropout masks in every run
    logits = model(ids)
    F.cross_entropy(logits.reshape(-1, VOCAB), targets).backward()
    return logits.detach()


def profile_step(model, checkpoint_mode=None, scoped_head=True):
    model.checkpoint = checkpoint_mode
    prof = ModuleProfiler(model)
    if scoped_head:
        model.head = prof.scoped_call(model.embed, lm_head)
    prof.start()
    start = time.perf_counter()
    train_step(model, *make_batch())
    wall_s = time.perf_counter() - start
    prof.stop()
    return prof, wall_s


def by_path(tree, prefix=""):
    nodes = {prefix or tree["name"]: tree}
    for child in tree["children"]:
        nodes.update(by_path(child, f"{prefix}/{child['name']}" if prefix else child["name"]))
    return nodes


def assert_schema_module(tree):
    schema = json.loads((Path(patches.profiler.__file__).parent / "flops-profile.schema.json").read_text())
    jsonschema.validate(tree, {"$defs": schema["$defs"], "$ref": "#/$defs/module"})


def assert_nested(tree):
    """Children's FLOPs sum to at most the node's, children's latencies to at most the node's + 1 ms."""
    for node in by_path(tree).values():
        children = node["children"]
        for prefix in ("fwd", "bwd", "recompute"):
            for field in (f"{prefix}_flops", f"{prefix}_other_flops"):
                assert sum(child[field] for child in children) <= node[field], (node["name"], field)
            field = f"{prefix}_latency_s"
            assert sum(child[field] for child in children) <= node[field] + 1e-3, (node["name"], field)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("mode", CHECKPOINT_MODES)
def test_gpt_flops_are_exact_per_module_and_phase(mode):
    with torch_checkpoint.set_checkpoint_early_stop(False):  # the full layer is recomputed
        prof, wall_s = profile_step(TinyGPT(), mode)
    tree = prof.tree()
    recompute = LAYER_FWD if mode else 0
    assert prof.totals() == {"fwd_flops": LAYERS * LAYER_FWD + HEAD_FWD,
                             "bwd_flops": LAYERS * LAYER_BWD + 2 * HEAD_FWD,
                             "recompute_flops": LAYERS * recompute}
    nodes = by_path(tree)
    for index in range(LAYERS):
        layer = nodes[f"layers/{index}"]
        assert (layer["fwd_flops"], layer["bwd_flops"], layer["recompute_flops"]) == (LAYER_FWD, LAYER_BWD, recompute)
        assert (layer["fwd_calls"], layer["bwd_calls"], layer["recompute_calls"]) == (1, 1, int(mode is not None))
        attn = nodes[f"layers/{index}/attn"]
        assert attn["fwd_flops"] == 8 * B * S * H * H + ATTENTION_FWD
        assert attn["bwd_flops"] == 16 * B * S * H * H + 10 * B * S * S * H
        qkv = nodes[f"layers/{index}/attn/qkv"]
        assert (qkv["fwd_flops"], qkv["bwd_flops"]) == (6 * B * S * H * H, 12 * B * S * H * H)
        # The attention kernel's backward runs after proj's: it stays with attn, not with proj.
        proj = nodes[f"layers/{index}/attn/proj"]
        assert (proj["fwd_flops"], proj["bwd_flops"]) == (2 * B * S * H * H, 4 * B * S * H * H)
        fc2 = nodes[f"layers/{index}/mlp/fc2"]
        assert (fc2["fwd_flops"], fc2["bwd_flops"], fc2["recompute_flops"]) == (
            FC2_FWD, 2 * FC2_FWD, FC2_FWD if mode else 0)
        ln1 = nodes[f"layers/{index}/ln1"]
        assert (ln1["fwd_flops"], ln1["fwd_other_flops"], ln1["bwd_other_flops"]) == (
            0, LAYER_NORM_OTHER, 2 * LAYER_NORM_OTHER)
        assert ln1["recompute_other_flops"] == (LAYER_NORM_OTHER if mode else 0)
        for prefix in ("fwd", "bwd") + (("recompute",) if mode else ()):
            assert layer[f"{prefix}_latency_s"] > 0
    # The tied LM head, run through a plain function, is credited to the embedding: forward and backward.
    embed = nodes["embed"]
    assert (embed["fwd_flops"], embed["bwd_flops"], embed["recompute_flops"]) == (HEAD_FWD, 2 * HEAD_FWD, 0)
    assert embed["fwd_calls"] == 2 and embed["bwd_calls"] == 2  # the embedding, then the head
    assert embed["fwd_latency_s"] > 0 and embed["bwd_latency_s"] > 0
    assert tree["params"] == sum(p.numel() for p in prof.root_module.parameters())
    # The phases never share a second, even when the recompute runs inside the root's backward.
    assert tree["fwd_latency_s"] + tree["bwd_latency_s"] + tree["recompute_latency_s"] <= wall_s
    assert_schema_module(tree)
    assert_nested(tree)
    prof.remove()


def test_non_reentrant_early_stop_counts_only_what_is_recomputed():
    # torch stops recomputing once every saved tensor is back: fc2's input is saved before its GEMM runs.
    prof, _ = profile_step(TinyGPT(), "torch_non_reentrant")
    assert prof.totals()["recompute_flops"] == LAYERS * (LAYER_FWD - FC2_FWD)
    nodes = by_path(prof.tree())
    assert nodes["layers/0/mlp/fc2"]["recompute_flops"] == 0
    assert nodes["layers/0/mlp/fc1"]["recompute_flops"] == FC2_FWD
    assert_nested(prof.tree())
    prof.remove()


def test_plain_function_lands_on_the_caller_without_scoped_call():
    prof, _ = profile_step(TinyGPT(), scoped_head=False)
    tree = prof.tree()
    embed = by_path(tree)["embed"]
    assert (embed["fwd_flops"], embed["bwd_flops"]) == (0, 0)
    own_fwd = tree["fwd_flops"] - sum(child["fwd_flops"] for child in tree["children"])
    assert own_fwd == HEAD_FWD
    prof.remove()


def snapshot_hooks(model):
    return [(m._forward_hooks.copy(), m._forward_pre_hooks.copy(), m._backward_hooks.copy(),
             m._backward_pre_hooks.copy(), m._forward_hooks_with_kwargs.copy(),
             m._forward_hooks_always_called.copy(), m._forward_pre_hooks_with_kwargs.copy())
            for m in model.modules()]


def grads_of(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", CHECKPOINT_MODES)
def test_numerics_bitwise_identical_and_remove_leaves_nothing(mode):
    reference = TinyGPT(mode, hidden_dropout=0.1)
    batch = make_batch()
    expected_logits = train_step(reference, *batch)
    expected_grads = grads_of(reference)

    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    hooks_before = snapshot_hooks(model)
    prof = ModuleProfiler(model)
    model.head = prof.scoped_call(model.embed, lm_head)
    prof.start()
    logits = train_step(model, *batch)
    prof.stop()
    assert torch.equal(logits, expected_logits)
    assert all(torch.equal(a, b) for a, b in zip(grads_of(model), expected_grads))
    assert prof.totals()["fwd_flops"] > 0

    prof.remove()
    model.head = functools.partial(lm_head, model.embed)
    assert snapshot_hooks(model) == hooks_before
    assert torch._C._len_torch_dispatch_stack() == 0
    model.zero_grad(set_to_none=True)
    assert torch.equal(train_step(model, *batch), expected_logits)
    assert all(torch.equal(a, b) for a, b in zip(grads_of(model), expected_grads))


def test_remove_between_forward_and_backward():
    """A graph recorded while profiling runs its backward after remove(): same gradients, nothing counted."""
    reference = TinyGPT()
    ids, targets = make_batch()
    train_step(reference, ids, targets)
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    prof = ModuleProfiler(model)
    prof.start()
    loss = F.cross_entropy(model(ids).reshape(-1, VOCAB), targets)
    prof.remove()
    loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(grads_of(model), grads_of(reference)))
    assert prof.totals()["bwd_flops"] == 0


@pytest.mark.parametrize("mode", [None, "torch_non_reentrant"])
@pytest.mark.parametrize("backward", [False, True])
def test_activations_are_freed_while_profiling(mode, backward):
    """No hook holds an autograd node: graphs (recomputed ones included) die as without the profiler."""
    model = TinyGPT(mode)
    activations = []
    model.layers[0].mlp.act.register_forward_hook(lambda module, args, output: activations.append(weakref.ref(output)))
    prof = ModuleProfiler(model)
    prof.start()
    logits = model(make_batch()[0])
    if backward:
        logits.sum().backward()
    del logits
    gc.collect()
    assert len(activations) == (2 if mode and backward else 1)
    assert all(ref() is None for ref in activations)
    prof.stop()
    prof.remove()


def test_stop_reset_and_restart():
    model = TinyGPT()
    prof, _ = profile_step(model)
    first = prof.totals()
    train_step(model, *make_batch())  # stopped: not counted
    assert prof.totals() == first
    prof.reset()
    tree = prof.tree()
    assert tree["fwd_flops"] == tree["bwd_flops"] == 0 and tree["fwd_latency_s"] == 0.0
    prof.start()
    train_step(model, *make_batch())
    prof.stop()
    assert prof.totals() == first
    prof.remove()


# ---------------------------------------------------------------- modules that bypass aten


class FusedLayerNorm(nn.Module):
    """Stands in for apex's FusedLayerNorm: matched by class name."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias)


class OpaqueProjection(nn.Module):
    """Matrix work the dispatcher never sees (a custom kernel); here an element-wise stand-in."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(H))

    def forward(self, x):
        return x * self.scale


register_module_flops(OpaqueProjection, lambda module, inputs, output: 1000, "matrix",
                      bwd_fn=lambda module, inputs, output: 3000)


def test_module_formulas_other_and_matrix():
    model = nn.Sequential(nn.Linear(H, H), FusedLayerNorm(H), OpaqueProjection())
    prof = ModuleProfiler(model)
    prof.start()
    model(torch.randn(B, S, H)).sum().backward()
    prof.stop()
    nodes = by_path(prof.tree())
    norm = nodes["1"]
    assert (norm["fwd_flops"], norm["bwd_flops"]) == (0, 0)
    assert (norm["fwd_other_flops"], norm["bwd_other_flops"]) == (LAYER_NORM_OTHER, 2 * LAYER_NORM_OTHER)
    opaque = nodes["2"]
    assert (opaque["fwd_flops"], opaque["bwd_flops"], opaque["fwd_other_flops"]) == (1000, 3000, 0)
    root = nodes["Sequential"]
    # The first Linear's input needs no gradient: its backward is the weight gradient only.
    assert (root["fwd_flops"], root["bwd_flops"]) == (2 * B * S * H * H + 1000, 2 * B * S * H * H + 3000)
    assert root["fwd_other_flops"] == LAYER_NORM_OTHER
    prof.remove()


# ---------------------------------------------------------------- awkward modules


class TupleAndDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x, scale=1.0):
        y = self.lin(x)
        return y, {"aux": y * scale, "note": "not a tensor"}, 3


class InPlace(nn.Module):
    """In-place on its own input and on a child's output; a child run under no_grad; a frozen child."""

    def __init__(self):
        super().__init__()
        self.relu = nn.ReLU(inplace=True)
        self.lin = nn.Linear(H, H)
        self.frozen = nn.Linear(H, H).requires_grad_(False)

    def forward(self, x):
        x = self.relu(x)  # x is a non-leaf: modified in place
        y = self.lin(x)
        y.mul_(2.0)  # the child's output modified in place
        with torch.no_grad():
            self.lin(x)
        return self.frozen(y)


class Awkward(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Linear(H, H)  # left and right take a tensor that needs no gradient
        self.right = nn.Linear(H, H)
        self.pair = TupleAndDict()
        self.inplace = InPlace()

    def forward(self, x):
        h = self.left(x) + self.right(x)
        y, extra, _ = self.pair(h, scale=2.0)
        return self.inplace(y + extra["aux"])


def test_awkward_modules_exact_quiet_and_bitwise():
    torch.manual_seed(0)
    reference = Awkward()
    x = torch.randn(B, S, H)
    reference(x).sum().backward()
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    prof = ModuleProfiler(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prof.start()
        out = model(x)
        out.sum().backward()
        prof.stop()
    assert torch.equal(out, reference(x))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters())
               if a.requires_grad)
    gemm = 2 * B * S * H * H
    nodes = by_path(prof.tree())
    # No input gradient for left/right: each backward is its weight gradient, credited to the right sibling.
    assert [nodes[name]["bwd_flops"] for name in ("left", "right")] == [gemm, gemm]
    assert nodes["pair"]["bwd_flops"] == 2 * gemm
    # inplace.lin ran twice forward (once under no_grad), once backward; frozen needs only its input gradient.
    assert (nodes["inplace/lin"]["fwd_flops"], nodes["inplace/lin"]["bwd_flops"]) == (2 * gemm, 2 * gemm)
    assert nodes["inplace/lin"]["fwd_calls"] == 2 and nodes["inplace/lin"]["bwd_calls"] == 1
    assert (nodes["inplace/frozen"]["fwd_flops"], nodes["inplace/frozen"]["bwd_flops"]) == (gemm, gemm)
    assert prof.totals() == {"fwd_flops": 6 * gemm, "bwd_flops": 7 * gemm, "recompute_flops": 0}
    assert_nested(prof.tree())
    prof.remove()


class Failing(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x, fail=False):
        y = self.lin(x)
        if fail:
            raise RuntimeError("boom")
        return y


def test_exception_in_forward_leaves_a_clean_stack():
    model = nn.ModuleDict({"inner": Failing()})
    prof = ModuleProfiler(model, root_name="root")
    prof.start()
    with pytest.raises(RuntimeError):
        model["inner"](torch.randn(B, S, H), fail=True)
    torch.randn(B, H) @ torch.randn(H, H)  # outside any module: the root's own work, not the failed call's
    prof.stop()
    tree = prof.tree()
    inner = by_path(tree)["inner"]
    assert tree["name"] == "root"
    assert (inner["fwd_flops"], inner["fwd_calls"]) == (2 * B * S * H * H, 1)  # what ran before the raise
    assert tree["fwd_flops"] == 2 * B * S * H * H + 2 * B * H * H
    prof.remove()


# ---------------------------------------------------------------- attention formulas


def attention_inputs(dtype):
    return [torch.randn(B, HEADS, S, H // HEADS, dtype=dtype, requires_grad=True) for _ in range(3)]


def counted(fn):
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_flash_attention_formulas_in_torch_registry(dtype):
    q, k, v = attention_inputs(dtype)
    out = None

    def forward():
        nonlocal out
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)

    assert counted(forward) == ATTENTION_FWD
    assert counted(lambda: out.float().sum().backward()) == 10 * B * S * S * H
    flop_formulas._register_cpu_attention_formulas()  # idempotent: already registered, no error


def test_attention_math_fallback_with_dropout_counts_its_bmm():
    q, k, v = attention_inputs(torch.float32)
    prof = ModuleProfiler(nn.Identity())
    prof.start()
    F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1).sum().backward()
    prof.stop()
    # Q K^T and P V forward; dV, dP, dQ, dK backward: no recompute of the scores.
    assert prof.totals() == {"fwd_flops": ATTENTION_FWD, "bwd_flops": 2 * ATTENTION_FWD, "recompute_flops": 0}
    prof.remove()


class _LinearFunction(torch.autograd.Function):
    """A linear as a custom autograd Function, as Megatron's parallel linears are: autograd runs its forward
    with grad mode off, also when activation checkpointing re-runs it inside backward."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class _FunctionLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H, H) / H)

    def forward(self, x):
        return _LinearFunction.apply(x, self.weight)


@pytest.mark.parametrize("mode", ["torch_reentrant", "torch_non_reentrant", "deepspeed"])
def test_a_custom_autograd_function_recomputed_counts_as_recompute(mode):
    layer = _FunctionLinear()
    model = nn.Sequential(layer)
    x = torch.randn(B, S, H, requires_grad=True)
    prof = ModuleProfiler(model)
    prof.start()
    run_layer(mode, layer, x).sum().backward()
    prof.stop()
    tree = by_path(prof.tree())
    gemm = 2 * B * S * H * H
    assert (tree["0"]["fwd_flops"], tree["0"]["bwd_flops"], tree["0"]["recompute_flops"]) == (gemm, 2 * gemm, gemm)
    prof.remove()


def test_a_timing_pass_takes_the_counts_of_a_counting_pass_and_names_calls_that_differ():
    """count_flops=False times the same calls with no dispatch mode on the stack; adopt_counts gives it the
    counting pass's FLOPs exactly, and names the modules whose calls differ between the two iterations."""
    torch.manual_seed(0)
    model = TinyGPT()
    model.checkpoint = "torch_reentrant"
    counter, _ = profile_step(model, "torch_reentrant")
    counter.remove()
    timer = ModuleProfiler(model, count_flops=False)
    model.head = timer.scoped_call(model.embed, lm_head)
    timer.start()
    assert torch._C._len_torch_dispatch_stack() == 0
    train_step(model, *make_batch())
    timer.stop()
    assert timer.tree()["fwd_flops"] == 0  # nothing counted: the FLOPs come from the counting pass
    assert timer.adopt_counts(counter) == []
    assert _flops_only(timer.tree()) == _flops_only(counter.tree())
    assert timer.tree()["bwd_latency_s"] > 0
    timer.reset()
    timer.start()
    model.checkpoint = None  # the next iteration recomputes nothing
    train_step(model, *make_batch())
    timer.stop()
    differ = timer.adopt_counts(counter)
    assert differ and all(": recompute " in line for line in differ)
    with pytest.raises(ValueError, match="another module tree"):
        timer.adopt_counts(ModuleProfiler(TinyGPT()))
    timer.remove()


def test_the_same_calls_on_other_shapes_are_named_too():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def one_pass(batch, count_flops):
        profiler = ModuleProfiler(model, count_flops=count_flops)
        profiler.start()
        model(torch.randn(batch, 8)).sum().backward()
        profiler.stop()
        profiler.remove()
        return profiler

    counter = one_pass(4, True)
    assert one_pass(4, False).adopt_counts(counter) == []
    timer = one_pass(2, False)  # the same calls on a smaller batch: other FLOPs
    assert timer.adopt_counts(counter) == ["Sequential: fwd input shapes", "0: fwd input shapes",
                                           "1: fwd input shapes", "2: fwd input shapes"]


def _flops_only(tree):
    return {key: value for key, value in tree.items() if "latency" not in key and key != "children"} | {
        "children": [_flops_only(child) for child in tree["children"]]}
