"""The user's own profiling code, unchanged, on a 2-stage PipelineModule with activation checkpointing:
DeepSpeed's FlopsProfiler handed the PipelineEngine, printed on one rank.

    python user_flops_profiler.py MODE[+MODE...] OUT_DIR CONFIG

Several modes run one after another in this process (launches are the cost), each on an engine of its own built
from the same seed, so that each trains as it would alone.

MODE "every": start_profile() on every rank before the profiled train_batch; print_model_profile and
              end_profile() on the last stage's rank only (the user's report).
MODE "print": the code of a user's report of an empty pipeline profile: start_profile() on every rank;
              print_model_profile(profile_step) and end_profile() on the last stage's rank only (the walk's door).
MODE "stage0": start_profile() on stage 0's rank only; stage 0 prints (stage 1 must be named, not waited on).
MODE "none": no profiler (the reference losses).
MODE "unstarted": PipelineFlopsProfiler started on rank 0 only, get_report() on every rank (collective): both
              ranks must get the error naming rank 1, not hang.
MODE "write_error": PipelineFlopsProfiler on every rank, whose write_json rank 0 cannot write (a collective
              error every rank must learn of), then training goes on.
MODE "plain": a plain DeepSpeedEngine, the config's flops_profiler section on (for a later step); the
              user drives engine.flops_profiler on global rank 0 only, as stock DeepSpeed allows.
Each rank writes OUT_DIR/MODE.rank<r>.json: its losses (float.hex) and what the profiler left on it afterwards.
"""
import json
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.profiling.flops_profiler import FlopsProfiler
from deepspeed.utils.logging import set_log_level_from_string

from patches.profiler import PipelineFlopsProfiler
from tests.helpers.deepspeed_script import start_patched_gloo_run

WIDTH = 16
SEED = 0
PROFILED_BATCH = 2  # global_steps when the profiled train_batch starts (the third batch)
BATCHES = 4
ORIGINAL_LINEAR = F.linear


def batches(config, generator):
    while True:
        x = torch.randn(config["train_micro_batch_size_per_gpu"], WIDTH, generator=generator)
        yield x, x.flip(-1)


def leftovers(engine):
    """What a profiler could have left behind on this rank."""
    shadowed = sorted(name for name in ("_INSTRUCTION_MAP", "train_batch", "forward", "backward", "step")
                      if name in engine.__dict__)
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in engine.module.modules())
    return {"shadowed": shadowed, "module_hooks": hooks, "functional_patched": F.linear is not ORIGINAL_LINEAR,
            "profiling_active": bool(engine.__dict__.get("flops_profiling_active"))}


def pipeline_run(mode, out_dir, config):
    rank = torch.distributed.get_rank()
    module = PipelineModule(layers=[LayerSpec(torch.nn.Linear, WIDTH, WIDTH), LayerSpec(torch.nn.ReLU),
                                    LayerSpec(torch.nn.Linear, WIDTH, WIDTH), LayerSpec(torch.nn.ReLU)],
                            num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform",
                            activation_checkpoint_interval=1)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.01),
                                           config=config)
    model = [engine]  # Megatron-DeepSpeed's model list
    data = batches(config, torch.Generator().manual_seed(1))
    last_stage = engine.is_last_stage()
    collective = mode in ("write_error", "unstarted")
    prof = None if mode == "none" else PipelineFlopsProfiler(engine) if collective else FlopsProfiler(model[0])
    facts = {"losses": [], "is_deepspeed_flops_profiler": isinstance(prof, FlopsProfiler)}
    for _ in range(BATCHES):
        profiled = engine.global_steps == PROFILED_BATCH
        if profiled:
            facts["before_profiled_batch"] = leftovers(engine)
        if profiled and (mode in ("every", "print", "write_error") or (mode in ("stage0", "unstarted") and rank == 0)):
            prof.start_profile()
        loss = engine.train_batch(data_iter=data)
        facts["losses"].append(loss.item().hex())
        if profiled and mode == "unstarted":
            prof.stop_profile()
            try:
                prof.get_report()
            except RuntimeError as error:
                facts["report_error"] = str(error)
            prof.end_profile()
        if profiled and mode == "write_error":
            prof.stop_profile()
            try:
                prof.write_json("/proc/no_such_dir/report.json")
            except OSError as error:
                facts["write_error"] = str(error)
            prof.end_profile()
        printer = last_stage if mode in ("every", "print") else engine.stage_id == 0
        if profiled and mode in ("every", "print", "stage0") and printer:
            started = time.perf_counter()
            prof.print_model_profile(profile_step=PROFILED_BATCH + 1)
            facts["print_s"] = time.perf_counter() - started
            if mode == "every":
                prof.write_json(str(Path(out_dir) / "report.json"))
                facts["getters"] = [prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()]
                prof.print_model_aggregated_profile(module_depth=-1, top_modules=1)
            prof.end_profile()
        if profiled:
            facts["after_profiled_batch"] = leftovers(engine)
    Path(out_dir, f"{mode}.rank{rank}.json").write_text(json.dumps(facts))


def plain_run(out_dir, config):
    rank = torch.distributed.get_rank()
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                                           config=config)
    generator = torch.Generator().manual_seed(1)
    facts = {"losses": []}
    for step in range(BATCHES):
        if step == PROFILED_BATCH and rank == 0:
            engine.flops_profiler.start_profile()
        x = torch.randn(config["train_micro_batch_size_per_gpu"], WIDTH, generator=generator)
        loss = F.mse_loss(engine(x), x.flip(-1))
        engine.backward(loss)
        engine.step()
        facts["losses"].append(loss.item().hex())
        if step == PROFILED_BATCH and rank == 0:
            engine.flops_profiler.stop_profile()
            engine.flops_profiler.print_model_profile(profile_step=step + 1, detailed=False)
            facts["getters"] = [engine.flops_profiler.get_total_flops(), engine.flops_profiler.get_total_params()]
            engine.flops_profiler.end_profile()
    Path(out_dir, f"plain.rank{rank}.json").write_text(json.dumps(facts))


def main():
    modes, out_dir = sys.argv[-3].split("+"), sys.argv[-2]
    set_log_level_from_string("info")  # the engine's start-up lines
    config = start_patched_gloo_run(SEED)
    for mode in modes:
        torch.manual_seed(SEED)  # every mode's engine starts from the same weights
        if mode == "plain":
            plain_run(out_dir, config)
        else:
            pipeline_run(mode, out_dir, config)


if __name__ == "__main__":
    main()
