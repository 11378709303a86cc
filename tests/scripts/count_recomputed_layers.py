"""pretrain_gpt.py with a global forward hook that counts, apart from the profiler, the transformer layer
forwards run inside an autograd graph task (activation checkpointing re-running a layer in backward).

At exit each rank prints one line: `recomputed layer forwards: {"rank": R, "calls": {layer 1..L: calls}}`.
"""
import atexit
import json
import os
import runpy
import sys
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron.model.transformer import ParallelTransformerLayer  # noqa: E402  (ParallelTransformerLayerPipe's base)

calls = Counter()


def count_recompute(module, inputs, output):
    if isinstance(module, ParallelTransformerLayer) and torch._C._current_graph_task_id() != -1:
        calls[module.layer_number + 1] += 1


def report():
    print("recomputed layer forwards: " + json.dumps({"rank": int(os.environ.get("RANK", 0)),
                                                       "calls": dict(sorted(calls.items()))}), flush=True)


torch.nn.modules.module.register_module_forward_hook(count_recompute)
atexit.register(report)
sys.argv = [str(REPO / "pretrain_gpt.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
