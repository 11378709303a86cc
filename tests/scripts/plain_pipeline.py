"""A plain DeepSpeed pipeline script (no megatron code but the patches): 3 stages, a tied layer,
and the DeepSpeed config's flops_profiler section enabled. Its train_batch is wrapped on the instance, as a
library may wrap it; afterwards rank 0 says whether the engine was freed once the script let go of it."""
import gc
import weakref

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from tests.helpers.deepspeed_script import start_patched_gloo_run

WIDTH = 16


def tied_head(linear, x):
    # The tied module reused through forward_fn: a plain call, credited to the tied module.
    return F.linear(x, linear.weight)


def wrap_as_a_library_would(engine):
    wrapped = engine.train_batch
    engine.train_batch = lambda data_iter=None: wrapped(data_iter=data_iter)


def main():
    config = start_patched_gloo_run()
    layers = [
        TiedLayerSpec("tied", torch.nn.Linear, WIDTH, WIDTH),
        LayerSpec(torch.nn.Linear, WIDTH, WIDTH), LayerSpec(torch.nn.ReLU),
        LayerSpec(torch.nn.Linear, WIDTH, WIDTH), LayerSpec(torch.nn.ReLU),
        TiedLayerSpec("tied", torch.nn.Linear, WIDTH, WIDTH, forward_fn=tied_head),
    ]
    module = PipelineModule(layers=layers, num_stages=3, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    generator = torch.Generator().manual_seed(1)

    def batches():
        while True:
            x = torch.randn(config["train_micro_batch_size_per_gpu"], WIDTH, generator=generator)
            yield x, x.flip(-1)

    data = batches()
    wrap_as_a_library_would(engine)
    for _ in range(4):
        loss = engine.train_batch(data_iter=data)
    if torch.distributed.get_rank() == 0:
        print(f"final loss {loss.item():.6f}", flush=True)
    engine_ref = weakref.ref(engine)
    del engine, optimizer, module
    gc.collect()
    if torch.distributed.get_rank() == 0:
        print(f"engine freed: {engine_ref() is None}", flush=True)


if __name__ == "__main__":
    main()
