"""pretrain(): build the model on DeepSpeed, then train, log, evaluate, checkpoint and profile."""
import json
import math
import time
from dataclasses import dataclass
from typing import Optional

import deepspeed
import torch

from megatron import liveness, mpu
from megatron.arguments import exit_on_bad_args
from megatron.checkpointing import load_checkpoint, save_checkpoint
from megatron.data_iterators import pipeline_batches
from megatron.global_vars import get_args
from megatron.initialize import initialize_megatron
from megatron.model.gpt_model import pipeline_stage_layers
from megatron.optimizer import build_optimizer, global_params_norm, mark_tied_duplicates, optimizer_state_stats
from megatron.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training_log import IntervalStats, TrainingLogLine, throughput
from megatron.utils import print_rank_0, print_rank_last
from patches.process.errors import PatchConfigError
from patches.to_megatron.analytic_flops import gpt_run_description
from patches.to_megatron.megatron_door import MegatronDoor


def pretrain(train_valid_test_dataset_provider, model_provider, forward_step_func=None,
             extra_args_provider=None, args_defaults=None, argv=None):
    """Megatron's entry point: initialise, build, then run the training loop."""
    start = time.time()
    args = initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults, argv=argv)
    args.train_start_time = start  # --exit-duration-in-mins counts from here
    print_rank_0(f"> initialized: world {args.world_size} = pipeline {args.pipeline_model_parallel_size} x "
                 f"tensor {args.tensor_model_parallel_size} x data {args.data_parallel_size} "
                 f"({time.time() - start:.1f} s)")
    try:
        return _build_and_train(args, train_valid_test_dataset_provider, model_provider, forward_step_func)
    except Exception as error:
        # Every rank says why it stops, naming the rank that failed first, and exits non-zero at once.
        liveness.exit_after_failure(error, getattr(args, "curr_iteration", None))


def _build_and_train(args, train_valid_test_dataset_provider, model_provider, forward_step_func):
    train_ds, valid_ds, _ = train_valid_test_dataset_provider(_train_valid_test_num_samples(args))
    model, optimizer, lr_scheduler = setup_model_and_optimizer(model_provider)
    args.iteration, args.consumed_train_samples, args.consumed_train_tokens = 0, 0, 0
    if args.load:
        try:
            args.iteration, args.consumed_train_samples, args.consumed_train_tokens = \
                load_checkpoint(model[0], args.load, args)
        except PatchConfigError as error:  # e.g. a checkpoint of other pipeline parts (every rank raises it)
            exit_on_bad_args(str(error))
    if not args.consumed_train_tokens:
        args.consumed_train_tokens = args.consumed_train_samples * args.seq_length  # a fixed sequence length

    train_iterator = _build_iterator(train_ds, args.consumed_train_samples, args)
    iteration, exited = train(forward_step_func, model, optimizer, lr_scheduler, train_iterator, valid_ds)
    if exited:
        return model
    if args.eval_iters > 0 and valid_ds is not None:
        evaluate_and_print_results("the end of training", iteration, model, valid_ds, args,
                                   _tensorboard_writer(args))
    saved_by_interval = args.save_interval and iteration % args.save_interval == 0
    if args.save and iteration > args.iteration and not saved_by_interval:
        save_checkpoint(model[0], args.save, iteration, args)
    print_rank_0(f"> training done: {iteration} iterations")
    return model


def _train_valid_test_num_samples(args):
    evals = (args.train_iters // args.eval_interval + 1) * args.eval_iters
    return [args.train_iters * args.global_batch_size, evals * args.global_batch_size,
            args.eval_iters * args.global_batch_size]


def setup_model_and_optimizer(model_provider):
    args = get_args()
    module = model_provider()
    if isinstance(module, deepspeed.pipe.PipelineModule):
        mark_tied_duplicates(module)
    optimizer = build_optimizer(args, module)
    # Its step() reads the tokens consumed before the current iteration, as upstream's does.
    lr_scheduler = OptimizerParamScheduler.from_args(optimizer, args,
                                                     consumed_tokens=lambda: args.consumed_train_tokens)
    try:
        engine, optimizer, _, lr_scheduler = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=lr_scheduler, config=args.deepspeed_config_dict,
            mpu=None if isinstance(module, deepspeed.pipe.PipelineModule) else mpu)
    except PatchConfigError as error:  # e.g. a flops_profiler key the profiler cannot honour
        exit_on_bad_args(str(error))
    return [engine], optimizer, lr_scheduler


def _is_pipeline(engine):
    return isinstance(engine, deepspeed.runtime.pipe.engine.PipelineEngine)


def _needs_data(engine):
    """Only the first and last pipeline stages read micro-batches; the others get activations."""
    return not _is_pipeline(engine) or engine.is_first_stage() or engine.is_last_stage()


def _build_iterator(dataset, consumed_samples, args):
    if dataset is None:
        return None
    return pipeline_batches(dataset, consumed_samples, args.micro_batch_size,
                            mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank(), args.num_workers)


def train_step(forward_step_func, data_iterator, model, optimizer, lr_scheduler):
    """One iteration (all micro-batches, one optimizer step): (mean lm loss, whether the step was skipped).

    DeepSpeed skips the optimizer step (and the scheduler's) when the fp16 loss scaler overflows.
    """
    engine = model[0]
    if _is_pipeline(engine):
        loss = engine.train_batch(data_iter=data_iterator if _needs_data(engine) else None)
        return loss.item(), not engine.was_step_applied()
    losses = []
    for _ in range(engine.gradient_accumulation_steps()):
        loss = forward_step_func(data_iterator, engine)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    loss = torch.stack(losses).mean()
    torch.distributed.all_reduce(loss, group=mpu.get_data_parallel_group())
    return loss.item() / mpu.get_data_parallel_world_size(), not engine.was_step_applied()


def train(forward_step_func, model, optimizer, lr_scheduler, train_iterator, valid_ds):
    """The loop; returns (last iteration, whether --exit-interval or --exit-duration-in-mins ended it)."""
    args = get_args()
    engine = model[0]
    iteration = args.iteration
    writer = _tensorboard_writer(args)
    described = _describe_run(args)
    if described.recompute_note is not None:  # DeepSpeed's pipeline recomputes fewer layers than the flags ask
        print_rank_0(f"> {described.recompute_note}")
    # counts, profiles and reports --profile-flops-step's iteration; times every other one
    door = MegatronDoor(args, _ForkRun(args, writer), first_done=iteration)
    interval, interval_start = IntervalStats(), time.time()
    print_rank_0(f"> training from iteration {iteration} to {args.train_iters}"
                 + (f" or {args.train_tokens} tokens" if args.train_tokens is not None else ""))
    while iteration < args.train_iters and (args.train_tokens is None or
                                            args.consumed_train_tokens < args.train_tokens):
        step = iteration + 1
        args.curr_iteration = step
        loss, skipped = door.train_step(engine, step, lambda: train_step(forward_step_func, train_iterator, model,
                                                                          optimizer, lr_scheduler))
        iteration = step
        args.consumed_train_samples += args.global_batch_size
        args.actual_seq_length = args.seq_length
        args.consumed_train_tokens += args.global_batch_size * args.actual_seq_length
        _record_loss(args, iteration, loss)
        interval.add(loss, skipped)
        log = _IterationLog(loss=loss, learning_rate=optimizer.param_groups[0]["lr"],
                            loss_scale=_loss_scale(args, engine), grad_norm=_grad_norm(engine),
                            params_norm=global_params_norm(engine.module) if args.log_params_norm else None,
                            num_zeros=optimizer.num_zeros_in_grad if args.log_num_zeros_in_grad else None)
        if iteration % args.tensorboard_log_interval == 0:
            _write_iteration_scalars(args, writer, engine, optimizer, iteration, log)
        if iteration % args.log_interval == 0:
            seconds = (time.time() - interval_start) / interval.iterations
            _log_training(args, iteration, interval, seconds, log, writer, described.log_line_flops)
            interval, interval_start = IntervalStats(), time.time()
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(engine, args.save, iteration, args)
        if args.eval_iters > 0 and valid_ds is not None and iteration % args.eval_interval == 0 \
                and iteration != args.train_iters:
            evaluate_and_print_results(f"iteration {iteration}", iteration, model, valid_ds, args, writer)
        reason = _exit_reason(args, iteration)
        if reason is not None:
            door.finish()  # a report still waiting for its baseline iterations comes now
            saved = bool(args.save_interval) and iteration % args.save_interval == 0
            if args.save and not saved:
                save_checkpoint(engine, args.save, iteration, args)
            torch.distributed.barrier()
            print_rank_0(f"> exiting program {reason}")
            return iteration, True
    door.finish()
    return iteration, False


def _exit_reason(args, iteration):
    """Why the run stops after this iteration (--exit-duration-in-mins, --exit-interval), or None.

    The duration is decided by an all-reduce (every rank, every iteration), so all ranks stop together.
    """
    if args.exit_duration_in_mins is not None:
        minutes = (time.time() - args.train_start_time) / 60.0
        over = torch.tensor([int(minutes > args.exit_duration_in_mins)], dtype=torch.int32)
        torch.distributed.all_reduce(over, op=torch.distributed.ReduceOp.MAX)
        if over.item():
            return f"after {minutes:.2f} minutes (--exit-duration-in-mins {args.exit_duration_in_mins})"
    if args.exit_interval and iteration % args.exit_interval == 0:
        return f"at iteration {iteration} (--exit-interval {args.exit_interval})"
    return None


class _ForkRun:
    """What our arguments say of the run, for the profiler's door (patches' MegatronRun)."""

    def __init__(self, args, tensorboard_writer):
        self.args, self.tensorboard_writer = args, tensorboard_writer

    def describe(self, engine):
        return _describe_run(self.args)

    def shapes_change(self):
        return None  # every iteration of ours runs --seq-length tokens

    def announce(self, announcement):
        section = self.args.deepspeed_config_dict.get("flops_profiler", {})
        if section.get("enabled"):
            section_step = section.get("profile_step", 1)
            print_rank_0(f"> --profile-flops-step {self.args.profile_flops_step} takes precedence over the "
                         f"DeepSpeed config's flops_profiler section (profile_step {section_step}), which is ignored")
        print_rank_0(f"> FLOPs profiler: {announcement}")


def _describe_run(args):
    """What our arguments say of the run, for the profile report (the flag's; the config section's and the user's
    own FlopsProfiler code's through the door, which hands it to the engine)."""
    return gpt_run_description(args, pipeline_stage_layers(args), peak_tflops=args.peak_tflops,
                               # under --no-pipeline-parallel our GPTModel checkpoints, not DeepSpeed
                               activation_checkpointing=bool(args.checkpoint_activations)
                               if args.pp_recompute_layers is None else any(args.pp_recompute_layers))


def _record_loss(args, iteration, loss):
    """Exact per-iteration losses for tests and tools (float.hex keeps every bit)."""
    if args.loss_record_file and torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        with open(args.loss_record_file, "a") as f:
            f.write(json.dumps({"iteration": iteration, "loss": loss, "loss_hex": float(loss).hex()}) + "\n")


@dataclass
class _IterationLog:
    """This iteration's figures, for the log line and TensorBoard."""
    loss: float
    learning_rate: float
    loss_scale: Optional[float]
    grad_norm: Optional[float]
    params_norm: Optional[float]
    num_zeros: Optional[float]


def _loss_scale(args, engine):
    """DeepSpeed's current fp16 loss scale (None without fp16, as upstream prints none)."""
    if not args.fp16:
        return None
    optimizer = engine.optimizer
    scale = getattr(optimizer, "cur_scale", None)  # the ZeRO optimizer
    return float(getattr(optimizer, "loss_scale", None) if scale is None else scale)  # FP16_Optimizer


def _grad_norm(engine):
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def _log_training(args, iteration, interval, seconds_per_iteration, log, writer, flops_per_iteration):
    line = TrainingLogLine(
        iteration=iteration, train_iters=args.train_iters, consumed_samples=args.consumed_train_samples,
        consumed_tokens=args.consumed_train_tokens, seconds_per_iteration=seconds_per_iteration,
        learning_rate=log.learning_rate, global_batch_size=args.global_batch_size, lm_loss=interval.mean_loss,
        loss_scale=log.loss_scale, grad_norm=log.grad_norm, params_norm=log.params_norm,
        actual_seqlen=args.actual_seq_length, skipped_iterations=interval.skipped, nan_iterations=interval.nan,
        rates=throughput(args, seconds_per_iteration, flops_per_iteration), num_zeros=log.num_zeros)
    print_rank_last(line.format())
    if writer is not None and args.log_timers_to_tensorboard:
        _add_scalar_vs(args, writer, "iteration-time/iteration-time", seconds_per_iteration, iteration)
        writer.flush()


def _add_scalar_vs(args, writer, tag, value, iteration):
    """Upstream's triple: against iterations, consumed samples and consumed tokens."""
    writer.add_scalar(tag, value, iteration)
    writer.add_scalar(f"{tag} vs samples", value, args.consumed_train_samples)
    writer.add_scalar(f"{tag} vs tokens", value, args.consumed_train_tokens)


def _write_iteration_scalars(args, writer, engine, optimizer, iteration, log):
    """Upstream's per-iteration TensorBoard scalars (written by the last rank; the optimizer-state
    figures need every rank, so all compute them when they are asked for)."""
    stats = None
    if args.log_optimizer_states_to_tensorboard and args.tensorboard_dir:
        stats = optimizer_state_stats(optimizer, args.zero_stage)
    if writer is None:
        return
    writer.add_scalar("steps-vs-samples/y=steps,x=samples", iteration, args.consumed_train_samples)
    writer.add_scalar("steps-vs-samples/y=samples,x=steps", args.consumed_train_samples, iteration)
    writer.add_scalar("steps-vs-tokens/y=steps,x=tokens", iteration, args.consumed_train_tokens)
    writer.add_scalar("steps-vs-tokens/y=tokens,x=steps", args.consumed_train_tokens, iteration)
    if args.log_learning_rate_to_tensorboard:
        _add_scalar_vs(args, writer, "learning-rate/learning-rate", log.learning_rate, iteration)
    if args.log_batch_size_to_tensorboard:
        _add_scalar_vs(args, writer, "batch-size/batch-size", args.global_batch_size, iteration)
    _add_scalar_vs(args, writer, "lm-loss-training/lm loss", log.loss, iteration)
    if log.loss_scale and args.log_loss_scale_to_tensorboard:
        _add_scalar_vs(args, writer, "loss-scale/loss-scale", log.loss_scale, iteration)
    if args.log_world_size_to_tensorboard:
        _add_scalar_vs(args, writer, "world-size/world-size", args.world_size, iteration)
    if log.grad_norm is not None:
        _add_scalar_vs(args, writer, "grad-norm/grad-norm", log.grad_norm, iteration)
    if log.num_zeros is not None:
        _add_scalar_vs(args, writer, "num-zeros/num-zeros", log.num_zeros, iteration)
    if log.params_norm is not None:
        _add_scalar_vs(args, writer, "params-norm/params-norm", log.params_norm, iteration)
    _add_scalar_vs(args, writer, "seqlen/actual_seq_length", args.actual_seq_length, iteration)
    if stats is not None:
        for name, values in (("l2", stats.l2), ("l1", stats.l1), ("abs_max", stats.abs_max)):
            for quantity, value in values.items():
                writer.add_scalar(f"optimizer/{quantity}_{name}", value, iteration)
                writer.add_scalar(f"optimizer/{quantity}_{name} vs tokens", value, args.consumed_train_tokens)
    writer.flush()


_writer = None


def _tensorboard_writer(args):
    """The SummaryWriter of the last rank (it holds the loss), when --tensorboard-dir is given; one per run."""
    global _writer
    if not args.tensorboard_dir or torch.distributed.get_rank() != torch.distributed.get_world_size() - 1:
        return None
    if _writer is None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            message = "error: --tensorboard-dir needs the tensorboard package (pip install tensorboard)"
            raise SystemExit(message) from None
        _writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)
    return _writer


def evaluate(model, valid_ds, args):
    """Mean lm loss over --eval-iters global batches of the validation set."""
    engine = model[0]
    data = pipeline_batches(valid_ds, 0, args.micro_batch_size,
                            mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank(), args.num_workers)
    total = 0.0
    for _ in range(args.eval_iters):
        if _is_pipeline(engine):
            loss = engine.eval_batch(data_iter=data if _needs_data(engine) else None)
        else:
            with torch.no_grad():
                losses = []
                for _ in range(engine.gradient_accumulation_steps()):
                    tokens, (labels, loss_mask) = next(data)
                    device = engine.device
                    losses.append(engine(tokens.to(device), labels.to(device), loss_mask.to(device)))
                loss = torch.stack(losses).mean()
                torch.distributed.all_reduce(loss, group=mpu.get_data_parallel_group())
                loss = loss / mpu.get_data_parallel_world_size()
        total += float(loss)
    return total / max(args.eval_iters, 1)


def evaluate_and_print_results(prefix, iteration, model, valid_ds, args, writer=None):
    loss = evaluate(model, valid_ds, args)
    ppl = math.exp(min(20.0, loss))
    line = f" validation loss at {prefix} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    print_rank_last("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
    if writer is not None:
        _add_scalar_vs(args, writer, "lm-loss-validation/lm loss validation", loss, iteration)
        if args.log_validation_ppl_to_tensorboard:
            _add_scalar_vs(args, writer, "lm-loss-validation/lm loss validation ppl", ppl, iteration)
        writer.flush()
    return loss
