"""DeepSpeed public-API scenarios, several engines one after another in one launch (launches are the cost).

    deepspeed --num_gpus 2 compat_scenarios.py OUT_DIR MODE NAME [NAME ...]

MODE "stock": DeepSpeed as shipped, the flops_profiler section off (the reference training).
MODE "patched": patches.apply() first, the section on at PROFILE_STEP. Every rank writes
OUT_DIR/<name>.rank<r>.json: the losses (float.hex) and, patched, what engine.flops_profiler returned.
Global rank 0 also gets the printed report in OUT_DIR/<name>.profile.txt (the section's output_file).
"""
import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.utils import groups

from patches.process import clean_exit

WIDTH = 8
MICRO = 2
STEPS = 3
PROFILE_STEP = 2


# ---------------------------------------------------------------- models
def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Tanh(), torch.nn.Linear(2 * WIDTH, WIDTH))


def _double(x):
    return 2 * x


def _tied_head(linear, x):
    return F.linear(x, linear.weight)


def _flatten(x):
    return x.flatten(1)


def _pipeline_layers(kind):
    if kind == "functions":  # plain functions and lambdas between layers, a tied layer with and without forward_fn
        return [TiedLayerSpec("tied", torch.nn.Linear, WIDTH, WIDTH), _double,
                LayerSpec(torch.nn.Linear, WIDTH, WIDTH), lambda x: torch.tanh(x),
                LayerSpec(torch.nn.Linear, WIDTH, WIDTH),
                TiedLayerSpec("tied", torch.nn.Linear, WIDTH, WIDTH, forward_fn=_tied_head)]
    if kind == "conv":  # (MICRO, 1, 8, 8) images: convolution, pooling, a function layer, a Linear head
        return [LayerSpec(torch.nn.Conv2d, 1, 4, 3, padding=1), LayerSpec(torch.nn.ReLU),
                LayerSpec(torch.nn.MaxPool2d, 2), LayerSpec(torch.nn.Conv2d, 4, 4, 3, padding=1),
                LayerSpec(torch.nn.AvgPool2d, 2), _flatten, LayerSpec(torch.nn.Linear, 16, WIDTH),
                LayerSpec(torch.nn.Tanh), LayerSpec(torch.nn.Linear, WIDTH, WIDTH)]
    return [LayerSpec(torch.nn.Linear, WIDTH, WIDTH), LayerSpec(torch.nn.Tanh),
            LayerSpec(torch.nn.Linear, WIDTH, WIDTH), LayerSpec(torch.nn.Tanh)]


# ---------------------------------------------------------------- scenarios
# engine: "plain" or "pipe"; config: added to the base config; layers: the pipeline's layers;
# model: the plain engine's ("mlp", or "one_layer": DeepSpeed's own profiler unit test's Linear(10, 10) and
# cross-entropy, bf16 for its fp16: CPU has no fp16); section: the flops_profiler section both modes
# use, when not only the patched one; stock_config: what the stock run changes; training_data: train_batch()
# reads deepspeed.initialize's training_data; eval: eval_batch() on the profiled step, before train_batch();
# checkpoint: activation_checkpoint_interval 1 with checkpointable_layers.
ZERO_SGD = {"zero_allow_untested_optimizer": True}  # ZeRO with torch's SGD: DeepSpeed asks for this key

SCENARIOS = {
    "pipe_no_steps_per_print": {"engine": "pipe"},
    # Stock 0.19.8 crashes a pipeline with wall_clock_breakdown ("bwd_microstep timer has already been
    # started"): its reference run goes without the timers, which change no number.
    "pipe_wall_clock": {"engine": "pipe", "config": {"wall_clock_breakdown": True, "steps_per_print": 1},
                        "stock_config": {"wall_clock_breakdown": False}},
    "pipe_bf16": {"engine": "pipe", "config": {"bf16": {"enabled": True}}},
    "pipe_zero1": {"engine": "pipe", "config": {"zero_optimization": {"stage": 1}, **ZERO_SGD}},
    "pipe_training_data": {"engine": "pipe", "training_data": True},
    "pipe_eval_on_profiled_step": {"engine": "pipe", "eval": True},
    "pipe_functions": {"engine": "pipe", "layers": "functions"},
    "pipe_conv": {"engine": "pipe", "layers": "conv"},
    "pipe_checkpointing": {"engine": "pipe", "checkpoint": True},
    "plain_no_steps_per_print": {"engine": "plain"},
    "plain_wall_clock": {"engine": "plain", "config": {"wall_clock_breakdown": True, "steps_per_print": 1}},
    "plain_zero1": {"engine": "plain", "config": {"zero_optimization": {"stage": 1}, **ZERO_SGD}},
    "plain_zero2": {"engine": "plain", "config": {"zero_optimization": {"stage": 2}, **ZERO_SGD}},
    # Last in a launch: DeepSpeed's autotuning exits the process after end_profile_step.
    "plain_autotuning": {"engine": "plain", "autotuning": True, "section": None},
    "ds_unit_one_layer": {"engine": "plain", "model": "one_layer",
                          "config": {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                                     "steps_per_print": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
                                     "zero_optimization": {"stage": 0}, "bf16": {"enabled": True}},
                          "section": {"enabled": True, "step": 1, "module_depth": -1, "top_modules": 3}},
}


def _config(scenario, mode, name, out_dir):
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}
    config.update(scenario.get("config", {}))
    if mode == "stock":
        config.update(scenario.get("stock_config", {}))
    if scenario.get("autotuning"):
        config["autotuning"] = {"enabled": True, "start_profile_step": 1, "end_profile_step": 2,
                                "metric_path": str(out_dir / f"{name}.metric.json")}
    if "section" in scenario:
        if scenario["section"] is not None:
            config["flops_profiler"] = dict(scenario["section"])
    elif mode == "patched":
        config["flops_profiler"] = {"enabled": True, "profile_step": PROFILE_STEP, "detailed": False,
                                    "output_file": str(out_dir / f"{name}.profile.txt")}
    return config


def _batches(seed, image=False):
    generator = torch.Generator().manual_seed(seed)
    while True:
        if image:
            yield torch.randn(MICRO, 1, 8, 8, generator=generator), torch.randn(MICRO, WIDTH, generator=generator)
        else:
            x = torch.randn(MICRO, WIDTH, generator=generator)
            yield x, x.flip(-1)


class _Samples(torch.utils.data.Dataset):
    """training_data for deepspeed.initialize: fixed samples, so both runs read the same ones."""

    def __init__(self, count=64):
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(count, WIDTH, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.x[index].flip(-1)


def _profiler_numbers(engine):
    profiler = getattr(engine, "flops_profiler", None)
    if profiler is None:
        return None
    attributes = [getattr(profiler, name, None) for name in ("flops", "macs", "params")]
    if type(profiler).__module__.startswith("deepspeed"):  # stock: its getters fail after end_profile()
        return {"attributes": attributes}
    return {"flops": profiler.get_total_flops(), "macs": profiler.get_total_macs(),
            "params": profiler.get_total_params(), "duration": profiler.get_total_duration(),
            "flops_string": profiler.get_total_flops(as_string=True),
            "attributes": attributes, "totals": {key: profiler.get_report()["totals"][key]  # cached: no collective
                                                 for key in ("fwd_flops", "bwd_flops", "recompute_flops")}}


class OneLayer(torch.nn.Module):
    """DeepSpeed's unit-test SimpleModel with hidden_dim 10: one Linear, cross-entropy on its output."""

    def __init__(self, hidden_dim=10):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_dim, hidden_dim)
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        return self.cross_entropy_loss(self.linear(x), y)


def run_pipe(config, scenario):
    layers_kind = scenario.get("layers", "linear")
    checkpoint = {"activation_checkpoint_interval": 1, "checkpointable_layers": ["Linear"]} \
        if scenario.get("checkpoint") else {}
    stages = torch.distributed.get_world_size() // scenario.get("dp", 1)
    # Up to 4 stages of the conv net, each with one layer that has parameters (the optimizer needs some).
    partition = "type:Conv2d|Linear" if layers_kind == "conv" else "uniform"
    module = PipelineModule(layers=_pipeline_layers(layers_kind), num_stages=stages, loss_fn=torch.nn.MSELoss(),
                            partition_method=partition, **checkpoint)
    training_data = _Samples() if scenario.get("training_data") else None
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config,
                                           training_data=training_data)
    data = _batches(1, image=layers_kind == "conv")
    if engine.bfloat16_enabled():  # the first stage's inputs and the last stage's labels in the model's dtype
        data = ((x.to(torch.bfloat16), y.to(torch.bfloat16)) for x, y in data)
    losses, numbers = [], None
    for _ in range(STEPS):
        profiled = engine.global_steps == PROFILE_STEP
        if scenario.get("eval") and profiled:
            losses.append(engine.eval_batch(data_iter=data).item())
        loss = engine.train_batch() if training_data is not None else engine.train_batch(data_iter=data)
        losses.append(loss.item())
        if profiled:
            numbers = _profiler_numbers(engine)
    if numbers is not None and layers_kind == "conv":
        numbers["reference"] = _reference_flops(engine.micro_batches)
    return losses, numbers


def _reference_flops(micro_batches):
    """torch's FlopCounterMode over the same layers in this one process: {fwd_flops, bwd_flops} of a step."""
    from torch.utils.flop_counter import FlopCounterMode

    layers = [spec.build() if isinstance(spec, LayerSpec) else spec for spec in _pipeline_layers("conv")]
    data = _batches(1, image=True)
    counts = {}
    for phase in ("fwd_flops", "bwd_flops"):
        total = 0
        for _ in range(micro_batches):
            x, y = next(data)
            counter = FlopCounterMode(display=False)
            if phase == "fwd_flops":
                with counter:
                    loss = _run_layers(layers, x, y)
            else:
                loss = _run_layers(layers, x, y)
                with counter:
                    loss.backward()
            total += counter.get_total_flops()
        counts[phase] = total
    return counts


def _run_layers(layers, x, y):
    for layer in layers:
        x = layer(x)
    return torch.nn.functional.mse_loss(x, y)


def run_plain(config, model_kind, profile_step):
    # A PipelineEngine built earlier in this process left its grid in DeepSpeed's module-level groups.
    groups.mpu = None
    model = OneLayer() if model_kind == "one_layer" else _mlp()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    generator = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    data = _batches(1 + torch.distributed.get_rank())
    losses, numbers = [], None
    for _ in range(STEPS):
        profiled = engine.global_steps == profile_step
        for _ in range(engine.gradient_accumulation_steps()):
            if model_kind == "one_layer":
                x = torch.randn(engine.train_micro_batch_size_per_gpu(), 10, generator=generator)
                y = torch.randint(10, (x.shape[0],), generator=generator)
                loss = engine(x.to(_dtype(engine)), y)
            else:
                x, y = next(data)
                loss = F.mse_loss(engine(x.to(_dtype(engine))).float(), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if profiled:
            numbers = _profiler_numbers(engine)
    return losses, numbers


def _dtype(engine):
    return torch.float16 if engine.fp16_enabled() else torch.bfloat16 if engine.bfloat16_enabled() else torch.float32


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out_dir, mode, names = Path(args[0]), args[1], args[2:]
    if mode == "patched":
        import patches
        patches.apply()
    deepspeed.init_distributed(dist_backend="gloo")
    clean_exit.at_exit()
    rank = torch.distributed.get_rank()
    for name in names:
        scenario = SCENARIOS[name]
        torch.manual_seed(0)
        config = _config(scenario, mode, name, out_dir)
        if scenario["engine"] == "pipe":
            losses, numbers = run_pipe(config, scenario)
        else:
            section = scenario.get("section", {"profile_step": PROFILE_STEP})
            profile_step = (section or {}).get("profile_step", 1)
            losses, numbers = run_plain(config, scenario.get("model", "mlp"), profile_step)
        result = {"losses": [float(loss).hex() for loss in losses], "profiler": numbers}
        (out_dir / f"{name}.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
