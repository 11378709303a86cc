"""The ModuleProfiler of another checkout against this one's, interleaved in one process: what a change to the
counting and timing costs per iteration, without the noise of a pipeline on a shared machine.

    python bench/module_profiler_ab.py --baseline-root /path/to/main/checkout            # reference stage
    python bench/module_profiler_ab.py --baseline-root ... --shape 64 32 2 4 2 256       # small: per-op costs show

One process, one thread: a GPT stage (embedding, pre-norm layers with fused attention, LM head) trains
4 micro-batches forward and backward per iteration; each round runs a plain iteration, one under the
baseline's ModuleProfiler and one under this checkout's, and the medians of their CPU times are compared.
Both profilers must count the same FLOPs (checked). Default shape: one stage of profiler_overhead.py's
reference config (hidden 256, sequence 256, micro-batch 4, 2 layers, vocabulary 1024).
"""
import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def load_module_profiler(root):
    """ModuleProfiler of the checkout at `root` (its own `patches` package, imported afresh)."""
    for name in [m for m in sys.modules if m == "patches" or m.startswith("patches.")]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module("patches.profiler.module_profiler").ModuleProfiler
    finally:
        sys.path.remove(str(root))


def build_stage(hidden, seq, batch, heads, layers, vocab):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

        def forward(self, x):
            q, k, v = (t.view(batch, seq, heads, hidden // heads).transpose(1, 2)
                       for t in self.qkv(x).split(hidden, -1))
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(context.transpose(1, 2).reshape(batch, seq, hidden))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.attention, self.ln2 = nn.LayerNorm(hidden), Attention(), nn.LayerNorm(hidden)
            self.fc1, self.act, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            x = x + self.attention(self.ln1(x))
            return x + self.fc2(self.act(self.fc1(self.ln2(x))))

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(vocab, hidden)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.head = nn.Linear(hidden, vocab)

        def forward(self, tokens):
            x = self.embedding(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    torch.manual_seed(0)
    model, tokens = Stage(), torch.randint(0, vocab, (batch, seq))

    def iteration():
        for _ in range(4):
            model(tokens).float().pow(2).mean().backward()
    return model, iteration


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-root", required=True, help="the checkout to compare with")
    parser.add_argument("--shape", type=int, nargs=6, default=[256, 256, 4, 4, 2, 1024],
                        metavar=("HIDDEN", "SEQ", "BATCH", "HEADS", "LAYERS", "VOCAB"))
    parser.add_argument("--rounds", type=int, default=21)
    options = parser.parse_args()
    baseline_class = load_module_profiler(options.baseline_root)
    current_class = load_module_profiler(HERE.parents[1])
    import torch

    torch.set_num_threads(1)
    model, iteration = build_stage(*options.shape)
    baseline, current = baseline_class(model), current_class(model)

    def profiled(profiler):
        def run():
            profiler.start()
            iteration()
            profiler.stop()
        return run

    runs = {"plain": iteration, "baseline": profiled(baseline), "this checkout": profiled(current)}
    for run in runs.values():  # warm-up
        run()
    for profiler in (baseline, current):
        profiler.reset()
    cpu = {name: [] for name in runs}
    for _ in range(options.rounds):
        for name, run in runs.items():
            start = time.process_time()
            run()
            cpu[name].append(time.process_time() - start)
    plain = statistics.median(cpu["plain"])
    print(f"shape (hidden, seq, batch, heads, layers, vocab): {options.shape}; {options.rounds} rounds, "
          "4 micro-batches each; CPU time medians")
    for name, times in cpu.items():
        print(f"{name:14s} {statistics.median(times) * 1e3:9.2f} ms  {statistics.median(times) / plain:.3f} x plain")
    same = all(baseline.tree()[k] == current.tree()[k] for k in ("fwd_flops", "bwd_flops", "recompute_flops"))
    print(f"FLOPs equal: {same}")


if __name__ == "__main__":
    main()
