"""The report layer on synthetic measurements of a pp=2 x tp=2 x dp=2 GPT whose numbers follow from formulas.

Times are multiples of 2**-12 s so that sums of them are exact whatever the order.
"""
import copy
import json
import random

import jsonschema
import pytest

from patches.profiler.files import load_schema, validate_report, write_json
from patches.profiler.peaks import peak_tflops_for
from patches.profiler.printer import HEADER, format_report
from patches.profiler.report import NOTES, build_report
from patches.profiler.tree_merge import aggregate_by_depth, merge_stage_trees
from tests.helpers.contexts import report_context

PP, TP, DP = 2, 2, 2
HIDDEN, VOCAB, SEQ = 8, 32, 16
MICRO_BATCHES, MICRO_BATCH_SIZE = 4, 2
TOKENS = MICRO_BATCHES * MICRO_BATCH_SIZE * SEQ  # of one replica's iteration
LAYERS_OF_STAGE = {0: ["0", "1"], 1: ["2", "3"]}
TICK = 2.0 ** -12

# Dense GPT, tied embedding once: word + position embeddings, L layers of 12h^2 + 13h, final norm.
DENSE_PARAMS = VOCAB * HIDDEN + SEQ * HIDDEN + 4 * (12 * HIDDEN ** 2 + 13 * HIDDEN) + 2 * HIDDEN
LAYER_FWD = 24 * TOKENS * HIDDEN ** 2 + 4 * TOKENS * SEQ * HIDDEN
HEAD_FWD = 2 * TOKENS * HIDDEN * VOCAB


def slowness(tp_rank):
    """tp rank 1 is slower, so a stage's times are tp rank 1's."""
    return 1 + 0.25 * tp_rank


def node(name, type_, children=(), params=0, replicated=0, fwd=0, bwd=0, recompute=0, other=0, ticks=1,
         checkpointed=False, calls=(0, 0, 0), f=1.0):
    """An inclusive node from its own share plus its children's; `checkpointed` modules re-run in backward."""
    children = list(children)

    def total(key, own):
        return own + sum(c[key] for c in children)

    return {
        "name": name, "type": type_, "children": children,
        "params": total("params", params), "replicated_params": total("replicated_params", replicated),
        "fwd_flops": total("fwd_flops", fwd), "bwd_flops": total("bwd_flops", bwd),
        "recompute_flops": total("recompute_flops", recompute),
        "fwd_other_flops": total("fwd_other_flops", other), "bwd_other_flops": total("bwd_other_flops", 2 * other),
        "recompute_other_flops": total("recompute_other_flops", other if checkpointed else 0),
        "fwd_latency_s": total("fwd_latency_s", ticks * TICK * f),
        "bwd_latency_s": total("bwd_latency_s", 2 * ticks * TICK * f),
        "recompute_latency_s": total("recompute_latency_s", ticks * TICK * f if checkpointed else 0.0),
        "fwd_calls": calls[0], "bwd_calls": calls[1], "recompute_calls": calls[2],
    }


def linear(name, type_, n_in, n_out, f, replicated_bias=False):
    """A tensor-parallel linear; the row-parallel bias is replicated on every tp rank."""
    weight, bias = n_in * n_out // TP, (n_out if replicated_bias else n_out // TP)
    flops = 2 * TOKENS * n_in * n_out // TP
    return node(name, type_, params=weight + bias, replicated=bias if replicated_bias else 0,
                fwd=flops, bwd=2 * flops, recompute=flops, ticks=3, checkpointed=True, calls=(4, 4, 4), f=f)


def layer_norm(name, f, checkpointed=True):
    return node(name, "LayerNorm", params=2 * HIDDEN, replicated=2 * HIDDEN, other=5 * TOKENS * HIDDEN,
                ticks=1, checkpointed=checkpointed, f=f)


def transformer_layer(name, f):
    h = HIDDEN
    attention_core = 4 * TOKENS * SEQ * h // TP  # QK^T and AV, counted dense
    attention = node("self_attention", "ParallelAttention", [
        linear("query_key_value", "ColumnParallelLinear", h, 3 * h, f),
        linear("dense", "RowParallelLinear", h, h, f, replicated_bias=True),
    ], fwd=attention_core, bwd=2 * attention_core, recompute=attention_core, ticks=2, checkpointed=True, f=f)
    mlp = node("mlp", "ParallelMLP", [
        linear("dense_h_to_4h", "ColumnParallelLinear", h, 4 * h, f),
        linear("dense_4h_to_h", "RowParallelLinear", 4 * h, h, f, replicated_bias=True),
    ], ticks=1, checkpointed=True, f=f)
    return node(name, "ParallelTransformerLayerPipe",
                [layer_norm("input_layernorm", f), attention, layer_norm("post_attention_layernorm", f), mlp],
                ticks=1, checkpointed=True, calls=(4, 4, 4), f=f)


def tied_embedding(stage_id, f):
    """The embedding on stage 0; on the last stage the same module also runs the LM head (forward_fn)."""
    head = HEAD_FWD // TP if stage_id == PP - 1 else 0
    embed = node("embed", "EmbeddingPipe", [
        node("word_embeddings", "VocabParallelEmbedding", params=VOCAB * HIDDEN // TP, ticks=2, f=f),
        node("position_embeddings", "Embedding", params=SEQ * HIDDEN, replicated=SEQ * HIDDEN, ticks=1, f=f),
    ], fwd=head, bwd=2 * head, other=TOKENS * HIDDEN, ticks=4 + 8 * stage_id, f=f)
    return node("tied_modules", "ModuleDict", [embed], ticks=0, f=f)


def stage_tree(stage_id, f):
    layers = [transformer_layer(name, f) for name in LAYERS_OF_STAGE[stage_id]]
    if stage_id == 0:
        children = [tied_embedding(0, f)] + layers
    else:  # DeepSpeed registers tied_modules where the head's spec is met: after the final norm
        children = layers + [layer_norm("4", f, checkpointed=False), tied_embedding(1, f)]
    return node("GPTModelPipe", "GPTModelPipe", children, ticks=1, f=f)


INSTRUCTION_TICKS = {
    0: {"LoadMicroBatch": (4, 4), "ForwardPass": (4, 160), "SendActivation": (4, 12), "RecvGrad": (4, 80),
        "BackwardPass": (4, 320), "ReduceTiedGrads": (1, 8), "ReduceGrads": (1, 16), "OptimizerStep": (1, 40)},
    1: {"LoadMicroBatch": (4, 4), "RecvActivation": (4, 60), "ForwardPass": (4, 200), "BackwardPass": (4, 400),
        "SendGrad": (4, 12), "ReduceTiedGrads": (1, 8), "ReduceGrads": (1, 16), "OptimizerStep": (1, 48)},
}
UNTIMED_TICKS = 20  # train_batch time outside every instruction


def instruction_s(stage_id, name, tp_rank):
    return INSTRUCTION_TICKS[stage_id][name][1] * TICK * slowness(tp_rank)


def train_batch_s(stage_id, tp_rank):
    ticks = sum(t for _, t in INSTRUCTION_TICKS[stage_id].values()) + UNTIMED_TICKS
    return ticks * TICK * slowness(tp_rank)


def rank_entries():
    entries = []
    for stage_id in range(PP):
        for dp_rank in range(DP):
            for tp_rank in range(TP):
                f = slowness(tp_rank)
                entry = {
                    "global_rank": stage_id * DP * TP + dp_rank * TP + tp_rank,
                    "stage_id": stage_id, "tp_rank": tp_rank, "dp_rank": dp_rank,
                    "modules": stage_tree(stage_id, f),
                    "instructions": {name: {"count": count, "total_s": instruction_s(stage_id, name, tp_rank)}
                                     for name, (count, _) in INSTRUCTION_TICKS[stage_id].items()},
                    "train_batch_latency_s": train_batch_s(stage_id, tp_rank),
                    "peak_memory_bytes": 1000 * (stage_id + 1) + tp_rank,
                }
                if dp_rank == 1:  # another replica: must not leak into the report but its time
                    entry["modules"]["fwd_flops"] *= 1000
                    entry["modules"]["params"] *= 1000
                    entry["train_batch_latency_s"] += 1.0
                entries.append(entry)
    random.Random(0).shuffle(entries)
    return entries


def make_context(**kwargs):
    """Step 7 of this pp x tp x dp run, checkpointed; kwargs: report_context's optional ones."""
    return report_context(7, PP, TP, DP, MICRO_BATCHES, MICRO_BATCH_SIZE, seq_length=SEQ,
                          activation_checkpointing=True, **kwargs)


def find(tree, *path):
    for name in path:
        tree = next(c for c in tree["children"] if c["name"] == name)
    return tree


@pytest.fixture(scope="module")
def report():
    return build_report(rank_entries(), make_context())


def test_totals_are_the_dense_model_and_its_flops(report):
    totals = report["totals"]
    assert totals["params"] == DENSE_PARAMS == 3888
    assert totals["fwd_flops"] == 4 * LAYER_FWD + HEAD_FWD
    assert totals["bwd_flops"] == 2 * (4 * LAYER_FWD + HEAD_FWD)
    assert totals["recompute_flops"] == 4 * LAYER_FWD
    for key in ("params", "fwd_flops", "bwd_flops", "recompute_flops"):
        assert type(totals[key]) is int


def test_stages_merge_tp_ranks_and_ignore_other_replicas(report):
    h = HIDDEN
    embedding = VOCAB * h + SEQ * h
    layer = 12 * h ** 2 + 13 * h
    stage0, stage1 = report["stages"]
    assert [s["stage_id"] for s in report["stages"]] == [0, 1]
    assert stage0["global_ranks"] == [0, 1] and stage1["global_ranks"] == [4, 5]
    # dense stage size: the tied embedding is on both stages, replicated params once
    assert stage0["params"] == embedding + 2 * layer
    assert stage1["params"] == embedding + 2 * layer + 2 * h
    # one rank holds its shard of the sharded part and all of the replicated part
    assert stage0["params_per_gpu"] == VOCAB * h // TP + SEQ * h + 2 * ((12 * h ** 2 + 7 * h) // TP + 6 * h)
    assert stage0["fwd_flops"] == 2 * LAYER_FWD and stage1["fwd_flops"] == 2 * LAYER_FWD + HEAD_FWD
    assert stage1["recompute_flops"] == 2 * LAYER_FWD
    for s in (0, 1):
        stage = report["stages"][s]
        assert stage["fwd_latency_s"] == instruction_s(s, "ForwardPass", 1)
        assert stage["bwd_latency_s"] == instruction_s(s, "BackwardPass", 1)
        assert stage["step_latency_s"] == instruction_s(s, "OptimizerStep", 1)
        assert stage["train_batch_latency_s"] == train_batch_s(s, 1)
        assert stage["train_batch_latency_max_dp_s"] == train_batch_s(s, 1) + 1.0
        assert stage["other_s"] == UNTIMED_TICKS * TICK * slowness(1)
        assert stage["reduce_s"] == instruction_s(s, "ReduceGrads", 1) + instruction_s(s, "ReduceTiedGrads", 1)
        assert stage["peak_memory_bytes"] == 1000 * (s + 1) + 1
        assert stage["instructions"]["ForwardPass"] == {"count": 4, "total_s": instruction_s(s, "ForwardPass", 1)}
        assert stage["instructions"]["OptimizerStep"]["count"] == 1
    assert stage0["comm_s"] == instruction_s(0, "SendActivation", 1) + instruction_s(0, "RecvGrad", 1)
    assert stage1["comm_s"] == instruction_s(1, "RecvActivation", 1) + instruction_s(1, "SendGrad", 1)


def test_module_nodes_merge_over_tp(report):
    h = HIDDEN
    stage0 = report["stages"][0]["modules"]
    fc2 = find(stage0, "0", "mlp", "dense_4h_to_h")
    assert fc2["params"] == 4 * h * h + h and fc2["replicated_params"] == h
    assert fc2["fwd_flops"] == 2 * TOKENS * 4 * h * h
    assert fc2["fwd_latency_s"] == 3 * TICK * slowness(1)
    assert fc2["fwd_calls"] == 4  # per rank, not summed over tp
    norm = find(stage0, "1", "input_layernorm")
    assert norm["params"] == 2 * h and norm["fwd_flops"] == 0
    assert norm["fwd_other_flops"] == TP * 5 * TOKENS * h  # executed on every tp rank
    assert find(stage0, "0")["params"] == 12 * h ** 2 + 13 * h


def test_model_tree_has_tied_module_once(report):
    tree = report["model_tree"]
    assert tree["name"] == "GPTModelPipe"
    assert [c["name"] for c in tree["children"]] == ["tied_modules", "0", "1", "2", "3", "4"]
    tied = find(tree, "tied_modules")
    assert tied["params"] == VOCAB * HIDDEN + SEQ * HIDDEN
    assert find(tree, "tied_modules", "embed", "word_embeddings")["params"] == VOCAB * HIDDEN
    assert tied["fwd_flops"] == HEAD_FWD and tied["bwd_flops"] == 2 * HEAD_FWD
    assert tied["fwd_other_flops"] == 2 * TP * TOKENS * HIDDEN  # both stages, every tp rank
    # the largest tp rank's latency on each stage, summed over the two stages
    embed_ticks = {0: 4 + 2 + 1, 1: 12 + 2 + 1}
    assert tied["fwd_latency_s"] == (embed_ticks[0] + embed_ticks[1]) * TICK * slowness(1)
    assert tree["params"] == report["totals"]["params"]
    assert tree["fwd_flops"] == report["totals"]["fwd_flops"]


def test_model_tree_orders_layers_numerically():
    def leaf(name):
        return node(name, "Layer", params=1)

    merged = merge_stage_trees([node("m", "M", [leaf("9"), leaf("tied")]), node("m", "M", [leaf("11"), leaf("10")])])
    assert [c["name"] for c in merged["children"]] == ["9", "tied", "10", "11"]


def test_throughput_formulas(report):
    totals = report["totals"]
    iter_s = max(train_batch_s(0, 1), train_batch_s(1, 1))
    assert totals["iter_latency_s"] == iter_s
    assert report["bounding_stage"] == 1
    assert totals["fwd_latency_s"] == instruction_s(1, "ForwardPass", 1)
    assert totals["step_latency_s"] == instruction_s(1, "OptimizerStep", 1)
    flops = totals["fwd_flops"] + totals["bwd_flops"] + totals["recompute_flops"]
    assert totals["tflops_per_gpu"] == flops / iter_s / (PP * TP) / 1e12
    assert totals["model_tflops_per_gpu"] == (totals["fwd_flops"] + totals["bwd_flops"]) / iter_s / (PP * TP) / 1e12
    assert totals["samples_per_s"] == MICRO_BATCHES * MICRO_BATCH_SIZE * DP / iter_s
    assert totals["tokens_per_s"] == totals["samples_per_s"] * SEQ
    assert totals["mfu"] is None and totals["analytic_flops"] is None
    stage0 = report["stages"][0]
    busy0 = sum(instruction_s(0, name, 1) for name in ("ForwardPass", "BackwardPass", "OptimizerStep"))
    assert stage0["busy_share"] == busy0 / iter_s


def test_mfu_and_analytic_when_given():
    analytic = {"fwd_flops": 4 * LAYER_FWD + HEAD_FWD, "bwd_flops": 2 * (4 * LAYER_FWD + HEAD_FWD),
                "recompute_flops": 4 * LAYER_FWD}
    report = build_report(rank_entries(), make_context(peak_tflops=312.0, analytic=analytic))
    totals = report["totals"]
    assert totals["mfu"] == totals["model_tflops_per_gpu"] / 312.0
    assert totals["analytic_flops"] == 16 * LAYER_FWD + 3 * HEAD_FWD
    assert totals["measured_over_analytic"] == 1.0
    validate_report(report)
    text = format_report(report)
    assert f"{100 * totals['mfu']:.2f}%" in text
    assert "measured / analytic:" in text and "1.0000" in text


def test_report_validates_and_round_trips(report, tmp_path):
    validate_report(report)
    path = tmp_path / "out" / "flops_profile_step7.json"
    write_json(report, str(path))
    assert json.loads(path.read_text()) == report
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind
    assert load_schema()["$id"] == "flops-profile/2"
    broken = copy.deepcopy(report)
    broken["totals"]["params"] = 3888.5  # counts are integers
    with pytest.raises(jsonschema.ValidationError):
        validate_report(broken)


def test_layout_errors_are_explicit():
    entries = rank_entries()
    with pytest.raises(ValueError, match="one entry from each"):
        build_report(entries[1:], make_context())
    mismatched = rank_entries()
    victim = next(e for e in mismatched if e["dp_rank"] == 0 and e["tp_rank"] == 1)
    victim["modules"]["children"].pop()
    with pytest.raises(ValueError, match="tp ranks disagree"):
        build_report(mismatched, make_context())


def test_aggregated_every_depth_consistent_with_parents(report):
    depths = aggregate_by_depth(report["model_tree"])
    assert len(depths) == 4  # root, layers, sublayers, linears and embeddings
    flops = [sum(row["flops"] for row in by_type.values()) for by_type in depths]
    params = [sum(row["params"] for row in by_type.values()) for by_type in depths]
    assert flops[0] == 3 * (4 * LAYER_FWD + HEAD_FWD) + 4 * LAYER_FWD
    assert all(lower <= upper for upper, lower in zip(flops, flops[1:]))
    assert all(lower <= upper for upper, lower in zip(params, params[1:]))
    assert depths[1]["ParallelTransformerLayerPipe"]["count"] == 4
    text = format_report(report, top_modules=10)
    aggregated = text.split("Aggregated Profile per GPU")[1].split("Detailed Profile per GPU")[0]
    for depth in range(4):
        assert f"depth {depth} (" in aggregated
    deepest = aggregated.split("depth 3 (")[1]
    for type_ in ("ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "Embedding"):
        assert f"'{type_}'" in deepest
    shallow = format_report(report, module_depth=1)
    assert "depth 1 (" in shallow and "depth 2 (" not in shallow
    assert "(query_key_value)" not in shallow and "(mlp)" not in shallow
    assert "(2): ParallelTransformerLayerPipe(" in shallow


def test_format_report_layout(report):
    text = format_report(report)
    assert HEADER in text
    assert "Profile Summary at step 7:" in text
    assert "Notations:" in text
    for formula in (NOTES["tflops_per_gpu"], NOTES["model_tflops_per_gpu"], NOTES["iter_latency_s"], NOTES["params"]):
        assert formula in text
    assert "MFU = model FLOPS per GPU / dense peak of the device:" in text
    assert "n/a: device peak unknown, pass --peak-tflops" in text
    assert "params of model (tp shards summed, replicated and tied params once):" in text
    assert "3.89 K" in text  # 3888 params
    assert "Stages (one data-parallel replica" in text
    assert "  1 *  " in text and "  0 *" not in text  # the bounding stage's marker
    assert "Instructions of stage 0 (ranks 0,1;" in text and "Instructions of stage 1 (ranks 4,5;" in text
    assert "Aggregated Profile per GPU" in text and "Detailed Profile per GPU" in text
    assert "\nGPTModelPipe(\n" in text
    assert "    (embed): EmbeddingPipe(" in text and "      (query_key_value): ColumnParallelLinear(" in text
    assert text.rstrip().endswith("-" * 78)
    assert "Detailed Profile per GPU" not in format_report(report, detailed=False)


def test_peak_table():
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert peak_tflops_for("NVIDIA A100 80GB PCIe", "fp32") == 19.5
    assert peak_tflops_for("NVIDIA A10", "fp16") == 125.0
    assert peak_tflops_for("NVIDIA A10G", "bf16") is None
    assert peak_tflops_for("NVIDIA H100 80GB HBM3", "bf16") == 989.5
    assert peak_tflops_for("NVIDIA H100 PCIe", "bfloat16") == 756.5
    assert peak_tflops_for("NVIDIA H200", "tf32") == 494.5
    assert peak_tflops_for("NVIDIA L40S", "bf16") == 362.05
    assert peak_tflops_for("NVIDIA L4", "bf16") == 121.0
    assert peak_tflops_for("Tesla V100-SXM2-32GB", "fp16") == 125.0
    assert peak_tflops_for("Tesla V100-SXM2-32GB", "bf16") is None
    assert peak_tflops_for("AMD Instinct MI300X", "bf16") == 1307.4
    assert peak_tflops_for("cpu", "fp32") is None
    assert peak_tflops_for("NVIDIA H200", "int8") is None


def test_single_rank_without_pipeline_instructions():
    """A pp=1 DeepSpeedEngine run: no schedule instructions, only the train_batch window."""
    tree = node("GPT", "GPT", [node("0", "Layer", params=10, fwd=100, bwd=200, ticks=2)], ticks=1)
    entry = {"global_rank": 0, "stage_id": 0, "tp_rank": 0, "dp_rank": 0, "modules": tree, "instructions": {},
             "train_batch_latency_s": 8 * TICK, "peak_memory_bytes": None}
    report = build_report([entry], report_context(7, 1, 1, 1, MICRO_BATCHES, MICRO_BATCH_SIZE, seq_length=SEQ))
    validate_report(report)
    assert report["totals"]["params"] == 10 and report["totals"]["bwd_flops"] == 200
    assert report["stages"][0]["other_s"] == 8 * TICK and report["stages"][0]["fwd_latency_s"] == 0.0
    assert report["totals"]["tflops_per_gpu"] == 300 / (8 * TICK) / 1 / 1e12
    assert "Profile Summary at step 7:" in format_report(report)
