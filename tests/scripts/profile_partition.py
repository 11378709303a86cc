"""A plain DeepSpeed pipeline whose last layer is much heavier than the others, cut by DeepSpeed's own methods or by
partition_method='profile' (patches/partition/method.py), trained with Adam, and resumed across partitions
(patches/to_deepspeed/pipeline_checkpoint.py).

    python profile_partition.py MODE[+MODE...] OUT_DIR CONFIG

Several modes run one after another in this process (launches are the cost), each on a PipelineModule of its own;
global rank 0 prints "== mode MODE" as each starts, so that each one's lines can be told apart.

MODE "measure": partition 'uniform'; 4 batches, a checkpoint in OUT_DIR/checkpoint after the second, the third
    profiled by PipelineFlopsProfiler, its report written to OUT_DIR/report.json.
MODE "profile": partition_method='profile:OUT_DIR/report.json' (the report of the run above), then, in another
    PipelineModule, partition_method='profile' with the report named by $DS_PIPE_PARTITION_PROFILE; no training.
MODE "missing_on_rank_1": rank 1 names a report that is not there, as on a node without the file (refused on
    every rank).
MODE "other_model": partition_method='profile:OUT_DIR/report.json' on a model with one layer more (refused).
MODE "resume_uniform", "resume_profile": that partition, the checkpoint loaded (with its optimizer state), 2
    batches; "resume_profile_no_optim": load_optimizer_states=False.
Global rank 0 writes OUT_DIR/MODE.json: the parts the PipelineModule was cut into, and the losses ("profile":
the parts of each module, {"file": ..., "environment": ...}); a resume
writes each rank's loaded parameters' sums (float64, by their global names) to OUT_DIR/MODE_params_RANK.json.
"""
import json
import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule

from patches.profiler import PipelineFlopsProfiler
from tests.helpers.deepspeed_script import start_patched_gloo_run

WIDTH, WIDE = 64, 16384


class Heavy(torch.nn.Module):
    """Out to a wide hidden layer and back: 512 times the work of a Linear(64, 64)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(WIDTH, WIDE), torch.nn.Linear(WIDE, WIDTH)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def layers(extra=0):
    return [LayerSpec(torch.nn.Linear, WIDTH, WIDTH) for _ in range(6 + extra)] + [LayerSpec(Heavy)]


def batches(micro_batch_size, first):
    """Micro-batch i is the same in every run (a resume starts at the first micro-batch after the checkpoint)."""
    index = first
    while True:
        x = torch.randn(micro_batch_size, WIDTH, generator=torch.Generator().manual_seed(1000 + index))
        index += 1
        yield x, x.flip(-1)


def main():
    modes, out_dir = sys.argv[-3].split("+"), Path(sys.argv[-2])
    config = start_patched_gloo_run()
    for mode in modes:
        if torch.distributed.get_rank() == 0:
            print(f"== mode {mode}", flush=True)
        run(mode, out_dir, config)


def run(mode, out_dir, config):
    report = f"profile:{out_dir / 'report.json'}"
    if mode == "profile":
        parts = {origin: [int(p) for p in PipelineModule(layers=layers(), num_stages=2, partition_method=method).parts]
                 for origin, method in (("file", report), ("environment", "profile"))}
        if torch.distributed.get_rank() == 0:
            (out_dir / f"{mode}.json").write_text(json.dumps(parts))
        return
    if mode == "missing_on_rank_1" and torch.distributed.get_rank() == 1:
        report = f"profile:{out_dir / 'missing.json'}"
    method = {"measure": "uniform", "other_model": report, "missing_on_rank_1": report, "resume_uniform": "uniform",
              "resume_profile": report, "resume_profile_no_optim": report}[mode]
    module = PipelineModule(layers=layers(extra=1 if mode == "other_model" else 0), num_stages=2,
                            loss_fn=torch.nn.MSELoss(), partition_method=method)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.Adam(module.parameters(), lr=0.01),
                                           config=config)
    per_batch = engine.gradient_accumulation_steps()
    first_batch = 0
    if mode.startswith("resume"):
        engine.load_checkpoint(str(out_dir / "checkpoint"), load_optimizer_states=not mode.endswith("no_optim"))
        first_batch = 2
        sums = {name: param.detach().double().sum().item() for name, param in module.named_parameters()}
        rank = torch.distributed.get_rank()
        (out_dir / f"{mode}_params_{rank}.json").write_text(json.dumps(sums))
    data = batches(config["train_micro_batch_size_per_gpu"], first_batch * per_batch)
    losses = []
    for batch in range(first_batch, 4):
        profiler = PipelineFlopsProfiler(engine) if mode == "measure" and batch == 2 else None
        if profiler is not None:
            profiler.start_profile()
        losses.append(engine.train_batch(data_iter=data).item())
        if profiler is not None:
            profiler.stop_profile()
            profiler.write_json(str(out_dir / "report.json"))
            profiler.end_profile()
        if mode == "measure" and batch == 1:
            engine.save_checkpoint(str(out_dir / "checkpoint"), tag="global_step2")
    if torch.distributed.get_rank() == 0:
        (out_dir / f"{mode}.json").write_text(json.dumps({"parts": [int(p) for p in module.parts],
                                                          "losses": losses}))


if __name__ == "__main__":
    main()
