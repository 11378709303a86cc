"""pretrain(): build the model on DeepSpeed, then train, log, evaluate, checkpoint and profile."""
import json
import math
import os
import time

import torch
import deepspeed

from megatron import liveness, mpu
from megatron.analytic_flops import gpt_flops_per_iteration
from megatron.checkpointing import load_checkpoint, save_checkpoint
from megatron.data_iterators import pipeline_batches
from megatron.global_vars import get_args
from megatron.initialize import initialize_megatron
from megatron.learning_rates import AnnealingLR
from megatron.optimizer import ClippedAdamW, mark_tied_duplicates
from megatron.utils import print_rank_0, print_rank_last


def pretrain(train_valid_test_dataset_provider, model_provider, forward_step_func=None,
             extra_args_provider=None, args_defaults=None, argv=None):
    """Megatron's entry point: initialise, build, then run the training loop."""
    start = time.time()
    args = initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults, argv=argv)
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
    args.iteration, args.consumed_train_samples = 0, 0
    if args.load:
        args.iteration, args.consumed_train_samples = load_checkpoint(model[0], args.load)

    train_iterator = _build_iterator(train_ds, args.consumed_train_samples, args)
    iteration = train(forward_step_func, model, optimizer, lr_scheduler, train_iterator, valid_ds)
    if args.eval_iters > 0 and valid_ds is not None:
        evaluate_and_print_results("the end of training", iteration, model, valid_ds, args)
    saved_by_interval = args.save_interval and iteration % args.save_interval == 0
    if args.save and iteration > args.iteration and not saved_by_interval:
        save_checkpoint(model[0], args.save, iteration, args.consumed_train_samples)
    print_rank_0(f"> training done: {iteration} iterations")
    return model


def _train_valid_test_num_samples(args):
    evals = (args.train_iters // args.eval_interval + 1) * args.eval_iters
    return [args.train_iters * args.global_batch_size, evals * args.global_batch_size,
            args.eval_iters * args.global_batch_size]


def get_param_groups(module):
    """Weight decay on matrices only; biases and LayerNorm parameters are not decayed."""
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim == 1 else decay).append(param)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def setup_model_and_optimizer(model_provider):
    args = get_args()
    module = model_provider()
    if isinstance(module, deepspeed.pipe.PipelineModule):
        mark_tied_duplicates(module)
    adam = dict(lr=args.lr, weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_eps)
    if args.fp16 or args.bf16 or args.zero_stage > 0:
        # DeepSpeed's fp16/bf16 and ZeRO optimizers wrap this one, hand it flat partitions and clip
        # by themselves: plain AdamW (which ZeRO also knows as tested).
        optimizer = torch.optim.AdamW(get_param_groups(module), **adam)
    else:
        optimizer = ClippedAdamW(get_param_groups(module), clip_grad=args.clip_grad, **adam)
    lr_scheduler = AnnealingLR(optimizer, max_lr=args.lr, min_lr=args.min_lr, warmup_steps=args.lr_warmup_iters,
                               decay_steps=args.lr_decay_iters, decay_style=args.lr_decay_style)
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=module, optimizer=optimizer, lr_scheduler=lr_scheduler, config=args.deepspeed_config_dict,
        mpu=None if isinstance(module, deepspeed.pipe.PipelineModule) else mpu)
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
                            mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank())


def train_step(forward_step_func, data_iterator, model, optimizer, lr_scheduler):
    """One iteration (all micro-batches, one optimizer step); returns the mean lm loss as a float."""
    engine = model[0]
    if _is_pipeline(engine):
        loss = engine.train_batch(data_iter=data_iterator if _needs_data(engine) else None)
        return loss.item()
    losses = []
    for _ in range(engine.gradient_accumulation_steps()):
        loss = forward_step_func(data_iterator, engine)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    loss = torch.stack(losses).mean()
    torch.distributed.all_reduce(loss, group=mpu.get_data_parallel_group())
    return loss.item() / mpu.get_data_parallel_world_size()


def train(forward_step_func, model, optimizer, lr_scheduler, train_iterator, valid_ds):
    args = get_args()
    engine = model[0]
    iteration = args.iteration
    writer = _tensorboard_writer(args)
    _announce_profiling(args, engine)
    analytic = gpt_flops_per_iteration(args)
    interval = {"loss": 0.0, "iters": 0, "start": time.time()}
    print_rank_0(f"> training from iteration {iteration} to {args.train_iters}")
    while iteration < args.train_iters:
        step = iteration + 1
        args.curr_iteration = step
        if args.profile_flops_step == step:
            loss = _profiled_train_step(args, step, forward_step_func, train_iterator, model, optimizer, lr_scheduler,
                                        writer)
        else:
            loss = train_step(forward_step_func, train_iterator, model, optimizer, lr_scheduler)
        iteration = step
        args.consumed_train_samples += args.global_batch_size
        _record_loss(args, iteration, loss)
        interval["loss"] += loss
        interval["iters"] += 1
        if iteration % args.log_interval == 0:
            _log_training(args, engine, iteration, interval, analytic, writer)
            interval = {"loss": 0.0, "iters": 0, "start": time.time()}
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(engine, args.save, iteration, args.consumed_train_samples)
        if args.eval_iters > 0 and valid_ds is not None and iteration % args.eval_interval == 0 \
                and iteration != args.train_iters:
            evaluate_and_print_results(f"iteration {iteration}", iteration, model, valid_ds, args, writer)
    return iteration


def _announce_profiling(args, engine):
    section = args.deepspeed_config_dict.get("flops_profiler", {})
    if args.profile_flops_step is None:
        return
    if section.get("enabled"):
        from patches.flops_profiler_config import yield_to_flag

        yield_to_flag(args.profile_flops_step)
        print_rank_0(f"> --profile-flops-step {args.profile_flops_step} takes precedence over the DeepSpeed "
                     f"config's flops_profiler section (profile_step {section.get('profile_step', 1)}), which is ignored")
    print_rank_0(f"> FLOPs profiler: iteration {args.profile_flops_step} will be profiled on every stage")


def _profiled_train_step(args, step, forward_step_func, train_iterator, model, optimizer, lr_scheduler,
                         writer=None):
    """Profile this step on every rank; rank 0 prints the report and writes the JSON and, beside it, the
    Chrome trace; the TensorBoard writer (on the last rank) gets the report's headline scalars."""
    from megatron.profiler import PipelineFlopsProfiler
    from megatron.profiler.report import profile_scalars

    profiler = PipelineFlopsProfiler(model[0], seq_length=args.seq_length, analytic=gpt_flops_per_iteration(args),
                                     peak_tflops=args.peak_tflops)
    profiler.start_profile()
    loss = train_step(forward_step_func, train_iterator, model, optimizer, lr_scheduler)
    profiler.stop_profile()
    profiler.print_model_profile(profile_step=step)
    os.makedirs(args.profile_flops_output, exist_ok=True)
    profiler.write_json(os.path.join(args.profile_flops_output, f"flops_profile_step{step}.json"))
    profiler.write_trace(os.path.join(args.profile_flops_output, f"pipeline_trace_step{step}.json"))
    if writer is not None:
        for tag, value in profile_scalars(profiler.get_report()).items():
            writer.add_scalar(tag, value, step)
        writer.flush()
    profiler.end_profile()
    return loss


def _record_loss(args, iteration, loss):
    """Exact per-iteration losses for tests and tools (float.hex keeps every bit)."""
    if args.loss_record_file and torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        with open(args.loss_record_file, "a") as f:
            f.write(json.dumps({"iteration": iteration, "loss": loss, "loss_hex": float(loss).hex()}) + "\n")


def _log_training(args, engine, iteration, interval, analytic, writer):
    elapsed = (time.time() - interval["start"]) / interval["iters"]
    loss = interval["loss"] / interval["iters"]
    lr = engine.optimizer.param_groups[0]["lr"] if hasattr(engine.optimizer, "param_groups") else float("nan")
    grad_norm = engine.get_global_grad_norm()
    samples_per_s = args.global_batch_size / elapsed
    tflops = sum(analytic.values()) / elapsed / args.world_size / 1e12
    fields = [
        f"iteration {iteration:8d}/{args.train_iters:8d}",
        f"consumed samples: {args.consumed_train_samples:12d}",
        f"elapsed time per iteration (ms): {elapsed * 1000.0:.1f}",
        f"learning rate: {lr:.3E}",
        f"global batch size: {args.global_batch_size:5d}",
        f"lm loss: {loss:.6E}",
    ]
    if grad_norm is not None:
        fields.append(f"grad norm: {float(grad_norm):.3f}")
    fields += [
        f"samples per second: {samples_per_s:.3f}",
        f"tokens per second: {samples_per_s * args.seq_length:.1f}",
        f"TFLOPs: {tflops:.4f}",
    ]
    print_rank_last(" " + " | ".join(fields) + " |")
    if writer is not None:
        writer.add_scalar("lm-loss-training/lm loss", loss, iteration)
        writer.add_scalar("learning-rate/learning-rate", lr, iteration)
        writer.add_scalar("iteration-time/iteration-time", elapsed, iteration)
        writer.add_scalar("throughput/tflops-per-gpu", tflops, iteration)
        if grad_norm is not None:
            writer.add_scalar("grad-norm/grad-norm", float(grad_norm), iteration)
        writer.flush()


def _tensorboard_writer(args):
    """A SummaryWriter on the last rank (it holds the loss), when --tensorboard-dir is given."""
    if not args.tensorboard_dir or torch.distributed.get_rank() != torch.distributed.get_world_size() - 1:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise SystemExit("error: --tensorboard-dir needs the tensorboard package (pip install tensorboard)")
    return SummaryWriter(log_dir=args.tensorboard_dir)


def evaluate(model, valid_ds, args):
    """Mean lm loss over --eval-iters global batches of the validation set."""
    engine = model[0]
    data = pipeline_batches(valid_ds, 0, args.micro_batch_size,
                            mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank())
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
        writer.add_scalar("lm-loss-validation/lm loss", loss, iteration)
    return loss
