"""The words of the report: what every number means, read by the JSON (`notes`), the printer
(its Notations block and table captions) and the Chrome trace (its clock_sync method), so the three
say the same thing."""

# How the reported replica's clocks are put on rank 0's (gather.measure_clock_offset).
CLOCK_SYNC = ("clock alignment = each rank of the reported replica pings global rank 0 over gloo; offset = "
              "midpoint of the shortest of its round trips, error at most half that round trip")

# What every number means; the printer shows these as its Notations block, so the printed formulas
# are the ones used here.
NOTES = {
    "replica": "one iteration (all micro-batches) of one data-parallel replica (the ranks with dp rank 0)",
    "flops": "matrix work only (GEMM, attention, convolution), 2 flops per multiply-accumulate; "
             "fwd = forward pass, bwd = backward kernels as executed, "
             "recompute = forward re-run inside backward by activation checkpointing",
    "stage_merge": "a stage's counts are summed over its tp ranks, its times are the largest over them "
                   "(module latencies all from the rank slowest in that phase), "
                   "instruction and module call counts are one rank's",
    "params": "params of model = sum over stages of the tp shards' params, parameters replicated over tp "
              "(norms, row-parallel biases) and tied modules counted once",
    "params_per_gpu": "params per GPU = a stage's parameters held by one rank (largest over its tp ranks)",
    "flops_per_gpu": "flops per GPU = flops of model / (pp * tp)",
    "latency": "fwd / bwd / step latency = total time of the ForwardPass / backward (BackwardPass, or a "
               "zero-bubble schedule's BackwardOnlyPass and WeightPass) / OptimizerStep instructions of the "
               "bounding stage",
    "bounding_stage": "bounding stage = the stage with the largest fwd + bwd + step time",
    "iter_latency_s": "iter latency = largest stage train_batch time (wall time of the iteration)",
    "perturbation": "perturbation = profiled iteration / median of the unprofiled iterations after it (a Megatron "
                    "loop prints its report once 3 have run, or at its end), else before it past the warm-up "
                    "(the run's first iteration, used alone only where nothing else ran, and then said), both wall "
                    "time (time.time()) around the train step on rank 0; the rates below use the "
                    "unprofiled time where the run measured one (unprofiled iter time), else iter latency; "
                    "the counting iteration (the one before, where the FLOPs were counted) is timed on the same "
                    "clock",
    "tflops_per_gpu": "hardware TFLOPS per GPU = (fwd + bwd + recompute flops) / unprofiled iter time (or iter "
                      "latency) / (pp * tp) / 1e12",
    "model_tflops_per_gpu": "model TFLOPS per GPU = (fwd + bwd flops) / unprofiled iter time (or iter latency) "
                            "/ (pp * tp) / 1e12",
    "samples_per_s": "samples/s = micro-batches * micro-batch size * dp / unprofiled iter time (or iter latency); "
                     "tokens/s = samples/s * seq length",
    "mfu": "MFU = model TFLOPS per GPU / the device's dense peak TFLOPS",
    "analytic": "analytic flops = Megatron-LM formula for this iteration, one replica (fwd + bwd + recompute); "
                "ratio = measured (fwd + bwd + recompute) / analytic",
    "comm_s": "comm+wait = Send*/Recv* instructions, including waiting for the neighbouring stage",
    "other_s": "other = train_batch time outside every instruction (at least 0)",
    "busy_share": "share = (fwd + bwd + step) / iter latency",
    "model_tree": "model tree = every stage's tree under one root; a module held by several stages "
                  "(tied) has its params once and its flops, calls and latencies summed over stages",
    "stage_tflops": "stage TFLOPS per GPU = the stage's (fwd + bwd + recompute flops) / unprofiled iter time (or "
                    "iter latency) / tp / 1e12",
    "bubble": "bubble: schedule span = stage 0's first instruction to the last backward instruction's end of any "
              "stage (clocks aligned to rank 0), idle = span - forward and backward instruction time of the stage's "
              "busiest tp rank, "
              "ideal idle fraction = the schedule's: 1F1B (pp - 1) / (micro-batches + pp - 1), ZB-H1 "
              "(pp - 1) / (3 * micro-batches + pp - 1) with F = B = W; "
              "wait for the bounding stage = its fwd + bwd + step - the stage's",
    "clock_sync": CLOCK_SYNC,
    "partition_plan": "partition plan = the contiguous partition of the measured layers (forward + backward + "
                      "recompute seconds each, each stage position keeping the work no layer accounts for) that "
                      "minimises the largest stage; predicted iteration = sum(t_s) + (micro-batches - 1) * max(t_s) "
                      "with t_s a stage's time per micro-batch (DeepSpeed's 1F1B), plus what that model leaves out "
                      "of the measured iteration",
    "memory": "memory per GPU = bytes as torch's allocator holds them, measured in the iteration that counted the "
              "FLOPs; state = params + grads + optimizer state as held (dtype, ZeRO, flat buffers); kept = a "
              "micro-batch's forward net allocation, held until its backward; predicted peak = base + state + "
              "max(in flight x kept + compute transient, step transient); measured peak = the allocator's highest "
              "level (CUDA: max_memory_allocated; CPU: torch.profiler's memory events)",
    "stragglers": "stragglers = per stage, each replica's train_batch, fwd, bwd and comm+wait time (its slowest "
                  "tp rank's) over all data-parallel replicas: min, median, max and the slowest replica's ranks",
}

# Under a stage's memory where the measured iteration was its optimizer's first step (optimizer_created_bytes > 0).
FIRST_STEP_PEAKS = ("the measured peak is that first step's, whose forward and backward ran without the optimizer's "
                    "state; the predicted one holds it throughout, as later iterations do: profile iteration 3 or "
                    "later to measure a steady one")

# Captions of the printer's tables.
STAGE_TABLE_CAPTION = "Stages (one data-parallel replica; counts summed over tp ranks, times the largest over them):"
LAYER_TABLE_CAPTION = ("Layers (the PipelineModule's, per iteration, on the stage that ran them; a plain function "
                       "layer's work is its stage's; the plan: contiguous, no stage empty, smallest bound):")
MEMORY_CAPTION = ("Memory per GPU (each stage's tp rank with the largest predicted peak, in the iteration that counted "
                  "the FLOPs; bytes allocated as torch's allocator counts them):")
STRAGGLER_TABLE_CAPTION = ("Stragglers (per stage, over the data-parallel replicas; a replica's time is its slowest "
                           "tp rank's):")
