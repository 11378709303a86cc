"""What upstream Megatron-DeepSpeed's parsed arguments say of its run, for the profiler: the report's run
description (the sequence length the iteration ran, the analytic FLOPs, the layers recomputed short of the flags,
the log line's FLOPs), each pipeline stage's layers, and why its iterations change shape (curriculum learning,
random-LTD). Read only: nothing of upstream is changed here."""
import copy
import json
import os
from argparse import Namespace
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass
class UpstreamMegatronRun:
    """Upstream's run as its parsed arguments say it, for the Megatron door (megatron_door.MegatronRun)."""
    args: Namespace
    say: Callable[[str], None]  # upstream's own print_rank_0, as its other start-up lines
    tensorboard_writer: Any = None

    def describe(self, engine) -> Any:
        return describe_run(self.args, engine)

    def shapes_change(self) -> Optional[str]:
        return shapes_change(self.args)

    def announce(self, announcement: str) -> None:
        self.say(f"> FLOPs profiler (patches): {announcement}; report files in {self.args.profile_flops_output}")


def shapes_change(args: Namespace) -> Optional[str]:
    """Why upstream's iterations differ in shape, as its arguments (and DeepSpeed config) say, or None: curriculum
    learning truncates each batch to args.curriculum_seqlen, random-LTD drops tokens in the middle layers."""
    reasons = [_curriculum(args), "random-LTD" if getattr(args, "random_ltd", False) else None]
    return ", ".join(reason for reason in reasons if reason) or None


def _curriculum(args: Namespace) -> Optional[str]:
    """The curriculum learning that shortens upstream's sequences to args.curriculum_seqlen, or None."""
    if getattr(args, "curriculum_learning_legacy", False) or _config_section_enabled(args, "curriculum_learning"):
        return "curriculum learning (the DeepSpeed config's curriculum_learning section)"
    if getattr(args, "data_efficiency_curriculum_learning", False):
        return "data-efficiency curriculum learning"
    return None


def _config_section_enabled(args: Namespace, section: str) -> bool:
    """Whether the DeepSpeed config enables `section`: upstream reads its config only after parsing the flags
    (into args.deepspeed_config_dict), so before that the file is read here."""
    config = getattr(args, "deepspeed_config_dict", None)
    if config is None and getattr(args, "deepspeed_config", None) and os.path.isfile(args.deepspeed_config):
        try:
            with open(args.deepspeed_config) as f:
                config = json.load(f)
        except ValueError:  # upstream's own reading of it says what is wrong
            config = None
    return bool(((config or {}).get(section) or {}).get("enabled", False))


def describe_run(args: Namespace, engine):
    """What upstream's arguments say of the run, for the report (RunDescription): at the sequence length the
    iteration ran (curriculum learning's, where it is on). A fork whose arguments lack what the description
    reads gets a report without those lines."""
    from patches.profiler.context import UNDESCRIBED

    try:
        return _described(args, engine)
    except (AttributeError, TypeError):
        return UNDESCRIBED


def _described(args: Namespace, engine):
    from patches.profiler.context import RunDescription
    from patches.to_megatron.analytic_flops import gpt_run_description

    view, stage_layers = _analytic_view(args, engine)
    if getattr(args, "random_ltd", False) or getattr(args, "data_efficiency_curriculum_learning", False):
        # random-LTD drops tokens in the middle layers and the data-efficiency pipeline may reshape the batch:
        # no formula of batch x length says what ran, so the report states only what was measured
        return RunDescription(seq_length=view.seq_length)
    log_line = copy.copy(args)  # upstream's log line reads its own flags, at the iteration's length
    log_line.seq_length = view.seq_length
    return gpt_run_description(view, stage_layers, log_line)


def iteration_seq_length(args: Namespace) -> int:
    """The sequence length the current iteration runs: curriculum learning's (args.curriculum_seqlen, which
    upstream's train() sets before each train_step) where it is on, else --seq-length."""
    seqlen = getattr(args, "curriculum_seqlen", None)
    return int(seqlen) if _curriculum(args) and seqlen else args.seq_length


def pipeline_stage_layers_of(module) -> Optional[list]:
    """Each stage's layers of a DeepSpeed PipelineModule (a transformer layer as its number 1..L, the others by
    name), read from its layer specs and stage boundaries (private names; None where they are missing)."""
    specs, parts = getattr(module, "_layer_specs", None), getattr(module, "parts", None)
    if specs is None or parts is None:
        return None
    names, number = [], 0
    for spec in specs:
        name = getattr(getattr(spec, "typename", spec), "__name__", type(spec).__name__)
        if "ParallelTransformerLayerPipe" in name:  # what PipelineModule checkpoints in a GPT model
            number += 1
            names.append(number)
        else:
            names.append(name)
    return [names[parts[i]:parts[i + 1]] for i in range(len(parts) - 1)]


def _analytic_view(args: Namespace, engine):
    """(upstream's arguments as the analytic formula reads them, each stage's layers or None). Upstream's
    GPTModelPipe checkpoints every activation_checkpoint_interval layers (--checkpoint-num-layers, or
    --recompute-num-layers under --recompute-granularity full --recompute-method uniform), by DeepSpeed's
    chunk rule; a plain engine (--no-pipeline-parallel) checkpoints inside its own transformer."""
    view = copy.copy(args)
    view.seq_length = iteration_seq_length(args)
    view.num_micro_batches = engine.gradient_accumulation_steps()
    stage_layers = pipeline_stage_layers_of(engine.module)
    planned = getattr(engine.module, "planned_recompute", None)
    if planned is not None:  # the profile's plan chose each stage's recompute with its parts
        view.pp_recompute_layers = planned
    if stage_layers is not None:
        interval = getattr(engine.module, "activation_checkpoint_interval", 0)
        view.checkpoint_activations, view.checkpoint_num_layers = interval > 0, max(interval, 1)
        view.recompute_method, view.no_pipeline_parallel = "uniform", False
    else:
        granularity, method = getattr(args, "recompute_granularity", None), getattr(args, "recompute_method", None)
        view.checkpoint_activations = bool(getattr(args, "checkpoint_activations", False)) or \
            (granularity, method) == ("full", "uniform")
        view.recompute_method = "uniform"
    return view, stage_layers
