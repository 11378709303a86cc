"""Flag lists the tests share, so one run can serve several tests and no layout is spelled twice."""

# A tiny GPT: big enough to have every kind of layer, small enough for a 2-core CI machine.
# Data read in-line (--num-workers 0): no worker processes to start on every rank of a 2-core machine. The batches
# are the same either way (test_data_iterators.py); the runs that keep upstream's default of 2 workers say so
# (UPSTREAM_WORKERS).
TINY_GPT = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--synthetic-vocab-size", "192",
    "--make-vocab-size-divisible-by", "8", "--log-interval", "1", "--eval-iters", "0", "--seed", "1234",
    "--num-workers", "0",
]
# Upstream's default DataLoader (2 worker processes per rank), after TINY_GPT: the last --num-workers counts.
UPSTREAM_WORKERS = ["--num-workers", "2"]

# The schedule the fork's training tests share: with --lr-decay-iters fixed, a 5- or 10-iteration run
# sees the same learning rates as the first iterations of a 20-iteration one, so runs can serve several tests.
SCHEDULE = ["--global-batch-size", "8", "--lr", "3e-3", "--lr-decay-iters", "20"]


def layout(pp=1, tp=1):
    """The flags of a pipeline x tensor parallel layout."""
    return ["--pipeline-model-parallel-size", str(pp), "--tensor-model-parallel-size", str(tp)]


PP2 = layout(pp=2) + ["--global-batch-size", "8"]
PP2_TP2 = layout(pp=2, tp=2) + ["--global-batch-size", "8"]
# pp2 x tp2 with activation checkpointing, 20 iterations: the fork's training test and the profiler's
# bitwise-identical-losses test share one such unprofiled run (conftest.pp2_tp2_plain_run).
PP2_TP2_CKPT = layout(pp=2, tp=2) + ["--train-iters", "20", "--checkpoint-activations"] + SCHEDULE
