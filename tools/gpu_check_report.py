"""Checks one run of tools/gpu_check.sh: its report against the hand count, its profiled iteration's time.

    python tools/gpu_check_report.py NAME LOG REPORT_JSON <the run's model flags>

Forward and recompute FLOPs and params must equal the exact formula (patches.to_megatron.analytic_flops, the
Megatron-LM count at 2 FLOPs a multiply-add); the backward is printed with its ratio to twice the forward,
since fused attention kernels recompute their scores in backward (counted as executed). The overhead is
the profiled iteration's `elapsed time per iteration` over the median of the unprofiled iterations after
it, from the same log line.
"""
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))  # this checkout's megatron

from megatron.arguments import parse_args  # noqa: E402
from megatron.model.gpt_model import pipeline_stage_layers  # noqa: E402
from megatron.tokenizer.tokenizer import padded_vocab_size  # noqa: E402
from patches.to_megatron.analytic_flops import gpt_flops_per_iteration  # noqa: E402

ITERATION_TIME = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
PROFILED_STEP = 3


def hand_params(args):
    h, layers, vocab = args.hidden_size, args.num_layers, args.padded_vocab_size
    return vocab * h + args.max_position_embeddings * h + layers * (12 * h * h + 13 * h) + 2 * h


def main(argv):
    name, log_path, report_path, flags = argv[0], argv[1], argv[2], argv[3:]
    pp = int(flags[flags.index("--pipeline-model-parallel-size") + 1])
    seq_length = flags[flags.index("--seq-length") + 1]
    args = parse_args(flags + ["--lr", "1e-4", "--train-iters", "8", "--checkpoint-activations",
                               "--max-position-embeddings", seq_length], world_size=pp)
    args.padded_vocab_size = padded_vocab_size(args.synthetic_vocab_size, args)
    expected = gpt_flops_per_iteration(args, stage_layers=pipeline_stage_layers(args))
    with open(report_path) as f:
        report = json.load(f)
    totals, perturbation = report["totals"], report.get("perturbation") or {}
    failures = []
    for key in ("fwd_flops", "recompute_flops"):
        if totals[key] != expected[key]:
            failures.append(f"{key} {totals[key]} != hand count {expected[key]}")
    if totals["params"] != hand_params(args):
        failures.append(f"params {totals['params']} != hand count {hand_params(args)}")
    with open(log_path) as f:
        times = {int(step): float(ms) for step, ms in ITERATION_TIME.findall(f.read())}
    unprofiled = [ms for step, ms in times.items() if step > PROFILED_STEP]
    overhead = times[PROFILED_STEP] / statistics.median(unprofiled)
    print(f"gpu check: {name}: fwd {totals['fwd_flops']:,} recompute {totals['recompute_flops']:,} "
          f"params {totals['params']:,} (hand count: {'equal' if not failures else 'DIFFERENT'}); "
          f"bwd {totals['bwd_flops']:,} = {totals['bwd_flops'] / expected['bwd_flops']:.4f} x (2 x fwd); "
          f"profiled iteration {times[PROFILED_STEP]:.1f} ms / median unprofiled "
          f"{statistics.median(unprofiled):.1f} ms "
          f"= {overhead:.3f} (the report's own perturbation, iterations before it: {perturbation.get('ratio')}); "
          f"{totals['tflops_per_gpu']:.1f} TFLOPS per GPU "
          f"({totals.get('throughput_basis', 'profiled')} iteration time)")
    for failure in failures:
        print(f"gpu check: {name}: FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
