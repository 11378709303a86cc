"""A plain DeepSpeedEngine script (no pipeline, no megatron code but the patches) with the
DeepSpeed config's flops_profiler section enabled; the report goes to output_file. Then a checkpoint saved and
loaded as DeepSpeed's API allows (no client state, the latest tag) in ./checkpoint."""

import deepspeed
import torch

from tests.helpers.deepspeed_script import start_patched_gloo_run

WIDTH = 32


def main():
    config = start_patched_gloo_run()
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(3):
        for _ in range(engine.gradient_accumulation_steps()):
            x = torch.randn(config["train_micro_batch_size_per_gpu"], WIDTH, generator=generator)
            loss = torch.nn.functional.mse_loss(engine(x), x)
            engine.backward(loss)
            engine.step()
    engine.save_checkpoint("checkpoint")  # the patched save, on an engine without pipeline parts
    load_path, _ = engine.load_checkpoint("checkpoint")
    assert load_path is not None


if __name__ == "__main__":
    main()
