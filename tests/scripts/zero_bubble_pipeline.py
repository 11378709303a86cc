"""A 2-stage pipeline whose linears defer their weight gradients the way upstream Megatron-DeepSpeed's
zero-bubble schedule does, profiled by the DeepSpeed config's flops_profiler section.

    python zero_bubble_pipeline.py MODE[+MODE...] OUT_DIR CONFIG       (tests/zero_bubble_tree first on PYTHONPATH)

Several modes run one after another in this process (launches are the cost), "1f1b" before "zero_bubble" (which
replaces DeepSpeed's TrainSchedule for good), each on an engine of its own from the same seed; "{mode}" in CONFIG
is replaced by the mode's name.

MODE "1f1b": DeepSpeed's TrainSchedule; each linear's weight-gradient GEMM runs inside its backward.
MODE "zero_bubble": a schedule in TrainSchedule's place splits every BackwardPass into BackwardOnlyPass (the
    input gradients; the linears put their weight-gradient GEMMs into WeightGradStore) and a WeightPass per
    micro-batch at the end of the batch (the stored GEMMs, run outside autograd), both added to DeepSpeed's
    instruction map, as upstream's --enable-zbh1-pipeline does (written for this test, no upstream code).
Batch 2 is profiled (its FLOPs counted in batch 1); torch's FlopCounterMode counts batch 3 on every rank.
Global rank 0 writes OUT_DIR/MODE.json: the report engine.flops_profiler holds, torch's total, the losses.
"""
import json
import sys
from pathlib import Path

import deepspeed
import deepspeed.runtime.pipe.schedule as ds_schedule
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.engine import PipelineEngine
from torch.utils.flop_counter import FlopCounterMode

import patches
from megatron.core.tensor_parallel.weight_grad_store import WeightGradStore

WIDTH, BATCHES, PROFILED_BATCH = 16, 4, 2


def _accumulate_weight_grad(total_input, grad_output, weight):
    grad = grad_output.t().matmul(total_input)
    if weight.grad is None:
        weight.grad = grad
    else:
        weight.grad += grad


class _LinearDeferringWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        WeightGradStore.put(x.reshape(-1, x.shape[-1]), grad_output.reshape(-1, grad_output.shape[-1]), weight,
                            _accumulate_weight_grad)
        return grad_output.matmul(weight), None, grad_output.reshape(-1, grad_output.shape[-1]).sum(0)


class DeferringLinear(torch.nn.Linear):
    """A linear whose backward hands its weight-gradient GEMM to WeightGradStore (run at once under 1F1B)."""

    def forward(self, x):
        return _LinearDeferringWeightGrad.apply(x, self.weight, self.bias)


class BackwardOnlyPass(ds_schedule.BufferOpInstruction):
    """The input gradients of a micro-batch; its weight gradients wait in WeightGradStore."""


class WeightPass(ds_schedule.PipeInstruction):
    """The weight gradients of the oldest micro-batch whose backward deferred them."""


class DeferredWeightGradSchedule(ds_schedule.TrainSchedule):
    """1F1B, each backward split in two: its weight gradients run at the end of the batch, before the reduction."""

    def steps(self):
        deferred = 0
        for cmds in super().steps():
            out = []
            for cmd in cmds:
                if isinstance(cmd, ds_schedule.BackwardPass):
                    out.append(BackwardOnlyPass(cmd.buffer_id))
                    deferred += 1
                elif isinstance(cmd, ds_schedule.ReduceTiedGrads):
                    out += [WeightPass() for _ in range(deferred)] + [cmd]
                    deferred = 0
                else:
                    out.append(cmd)
            yield out


def _exec_backward_only_pass(self, buffer_id):
    WeightGradStore.set_combine_bw(False)
    try:
        self._exec_backward_pass(buffer_id)
    finally:
        WeightGradStore.flush()
        WeightGradStore.set_combine_bw(True)


def _exec_weight_pass(self):
    WeightGradStore.pop()


def use_zero_bubble_schedule():
    PipelineEngine._INSTRUCTION_MAP[BackwardOnlyPass] = _exec_backward_only_pass
    PipelineEngine._INSTRUCTION_MAP[WeightPass] = _exec_weight_pass
    ds_schedule.TrainSchedule = DeferredWeightGradSchedule


def main():
    modes, out_dir, config_pattern = sys.argv[-3:]
    # the DeepSpeed patches, upstream's WeightGradStore handed to the profiler, patches.process.clean_exit's
    # teardown at exit
    patches.apply_to_this_run([])
    deepspeed.init_distributed(dist_backend="gloo")
    for mode in modes.split("+"):
        with open(config_pattern.format(mode=mode)) as f:
            run(mode, out_dir, json.load(f))


def run(mode, out_dir, config):
    torch.manual_seed(0)
    if mode == "zero_bubble":
        use_zero_bubble_schedule()
    module = PipelineModule(layers=[LayerSpec(DeferringLinear, WIDTH, WIDTH), LayerSpec(torch.nn.ReLU),
                                    LayerSpec(DeferringLinear, WIDTH, WIDTH), LayerSpec(torch.nn.ReLU)],
                            num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.01),
                                           config=config)
    generator = torch.Generator().manual_seed(1)

    def batches():
        while True:
            x = torch.randn(config["train_micro_batch_size_per_gpu"], WIDTH, generator=generator)
            yield x, x.flip(-1)

    data, losses, report, torch_flops = batches(), [], None, None
    for batch in range(BATCHES):
        if batch == PROFILED_BATCH + 1:
            with FlopCounterMode(display=False) as counter:
                losses.append(engine.train_batch(data_iter=data).item().hex())
            torch_flops = counter.get_total_flops()
        else:
            losses.append(engine.train_batch(data_iter=data).item().hex())
        if batch == PROFILED_BATCH:
            report = engine.flops_profiler.get_report()  # the section's, held on every rank
    every_rank = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every_rank, torch_flops)
    if torch.distributed.get_rank() == 0:
        Path(out_dir, f"{mode}.json").write_text(json.dumps({"report": report, "torch_flops": sum(every_rank),
                                                             "losses": losses}))
    del engine, module


if __name__ == "__main__":
    main()
