"""A 2-stage pipeline whose batches grow longer every iteration, as a sequence-length curriculum makes them, with
the DeepSpeed config's flops_profiler section on and nothing in the config saying that the shapes change.

    python growing_sequence.py OUT_DIR CONFIG

Batch b (DeepSpeed's global_steps when it starts) has 4 + 2 b tokens per sequence. The section counts the FLOPs
of its profile_step in the batch before, whose shapes then turn out to differ: the profiler must not report the
counted FLOPs for it. Global rank 0 writes OUT_DIR/result.json: the report engine.flops_profiler holds, and the
sequence length of every batch."""
import json
import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule

from tests.helpers.deepspeed_script import start_patched_gloo_run

WIDTH, BATCHES = 16, 5


def seq_length(batch):
    return 4 + 2 * batch


def main():
    out_dir = sys.argv[-2]
    config = start_patched_gloo_run()
    module = PipelineModule(layers=[LayerSpec(torch.nn.Linear, WIDTH, WIDTH), LayerSpec(torch.nn.ReLU),
                                    LayerSpec(torch.nn.Linear, WIDTH, WIDTH), LayerSpec(torch.nn.ReLU)],
                            num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform", dynamic_shape=True)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.01),
                                           config=config)
    generator = torch.Generator().manual_seed(1)

    def batches(length):
        while True:
            x = torch.randn(config["train_micro_batch_size_per_gpu"], length, WIDTH, generator=generator)
            yield x, x.flip(-1)

    for batch in range(BATCHES):
        engine.train_batch(data_iter=batches(seq_length(batch)))
    report = engine.flops_profiler.get_report()  # the section's, held on every rank
    if torch.distributed.get_rank() == 0:
        Path(out_dir, "result.json").write_text(json.dumps(
            {"report": report, "seq_lengths": [seq_length(batch) for batch in range(BATCHES)]}))
    del engine, module


if __name__ == "__main__":
    main()
