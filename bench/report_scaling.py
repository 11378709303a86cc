"""What getting the profile report costs as data parallelism grows: the former design against the current one.

    python bench/report_scaling.py           # pp 2 x dp 1, 2, 4, 8 (2 to 16 ranks), simulated to 4,096
    python bench/report_scaling.py --quick   # the tiniest GPT, dp 1 and 2 (a smoke run)
    python bench/report_scaling.py --plot docs/report_scaling.png    # also draw the figures

Former design (copied here, no longer in the library): every rank's whole entry all-gathered over
the world (all_gather_object), rank 0 pinged by every other rank in turn, the report built on every
rank. Current design (patches/profiler/gather.py): replica 0's entries gathered to rank 0 over the
tensor and pipeline groups, one 256-byte sample per rank gathered to rank 0, the report built there
and broadcast, the replica's pp x tp ranks pinging rank 0.

Real runs: for each dp, the GPT pipeline is built on pp 2 x dp ranks, one iteration profiled, then
both designs get the report (alternately, `--repeats` times; medians). Measured per rank: the payload
bytes every collective delivered to it (counted at the torch.distributed calls: gathers, broadcasts,
receives), and the time of getting the report (slowest rank, between barriers).

Simulated runs (1,024 and 4,096 ranks, pp 2): the entries recorded in the largest real run are
replicated over the replicas; bytes follow from their pickled sizes; collective time from the
per-message (alpha) and per-byte (beta) costs of a gloo send and receive measured in the smallest run, with gloo's ring
all-gather ((n - 1) steps), a gather received one message after another at its root, and a binomial
broadcast (log2 n steps); unpickling and building are done for real, at that size.
"""
import argparse
import json
import math
import os
import pickle
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# A script: its own directory is on sys.path, so the sibling harness imports by name.
from harness import (
    TINY,
    build_pipeline_engine,
    load,
    machine,
    megatron_flags,
    quiet_logs,
    spawn,
    table,
    timed,
    unlink_shm_buffer,
)

PP = 2
SHAPE = {"hidden": 64, "heads": 4, "layers": 4, "seq": 32, "micro_batch": 1, "micro_batches": 4, "vocab": 256}
DPS, QUICK_DPS = (1, 2, 4, 8), (1, 2)
SIMULATED_WORLDS = (1024, 4096)
CLOCK_ROUNDS = 8  # gather.CLOCK_PING_ROUNDS, both designs


# ---------------------------------------------------------------- counting received bytes
class ByteCounter:
    """Payload bytes delivered to this rank by the collectives torch.distributed runs while counting."""

    def __init__(self):
        self.received = 0

    def all_gather(self, tensor_list, tensor, *args, **kwargs):
        self.received += sum(t.nbytes for t in tensor_list) - tensor.nbytes

    def gather(self, tensor, gather_list=None, *args, **kwargs):
        if gather_list:
            self.received += sum(t.nbytes for t in gather_list) - tensor.nbytes

    def broadcast(self, tensor, src=None, group=None, async_op=False, group_src=None):
        root = src if src is not None else dist.get_global_rank(group or dist.group.WORLD, group_src)
        if dist.get_rank() != root:
            self.received += tensor.nbytes

    def recv(self, tensor, *args, **kwargs):
        self.received += tensor.nbytes


@contextmanager
def counting(counter):
    """Count around the real calls (gather_object and friends call these module globals)."""
    originals = {name: getattr(c10d, name) for name in ("all_gather", "gather", "broadcast", "recv")}

    def wrap(name):
        original, count = originals[name], getattr(counter, name)

        def counted(*args, **kwargs):
            count(*args, **kwargs)
            return original(*args, **kwargs)
        return counted
    try:
        for name in originals:
            setattr(c10d, name, wrap(name))
            setattr(dist, name, getattr(c10d, name))
        yield counter
    finally:
        for name, original in originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)


# ---------------------------------------------------------------- the former design, kept to compare
def former_get_report(profiler, seq_length):
    """The report as get_report made it before: world-wide all_gather_object, sequential pings, every rank builds."""
    from patches.profiler.context import ReportContext, RunDescription
    from patches.profiler.gather import measure_clock_offset
    from patches.profiler.report import build_report

    entry = profiler.measurement.entry().as_dict()
    entry["clock_offset_s"], entry["clock_error_s"] = measure_clock_offset()  # every rank pings rank 0 in turn
    entries = [None] * dist.get_world_size()
    dist.all_gather_object(entries, entry)
    context = ReportContext.of(profiler.engine, profiler.layout, profiler.engine.global_steps,
                               RunDescription(seq_length=seq_length))
    return build_report(entries, context)


# ---------------------------------------------------------------- one real run
def init(shape, dp):
    from megatron.data_iterators import synthetic_datasets
    from megatron.initialize import initialize_megatron

    torch.set_num_threads(1)
    quiet_logs()
    flags = [str(flag) for flag in megatron_flags(shape, PP)]
    flags[flags.index("--global-batch-size") + 1] = str(shape["micro_batch"] * shape["micro_batches"] * dp)
    args = initialize_megatron(argv=flags, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    unlink_shm_buffer()
    args.train_dataset, _, _ = synthetic_datasets(args, [10**6, 0, 0])
    return args


def link_costs(rounds=20, big=1 << 20):
    """(alpha, beta, round trip of 8 bytes): rank 0 <-> the last rank over gloo, medians."""
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    costs = []
    for size in (8, big):
        message = torch.zeros(size, dtype=torch.uint8)
        trips = []
        for _ in range(rounds):
            dist.barrier()
            if rank == 0:
                start = time.perf_counter()
                dist.send(message, dst=last)
                dist.recv(message, src=last)
                trips.append(time.perf_counter() - start)
            elif rank == last:
                dist.recv(message, src=0)
                dist.send(message, dst=0)
        costs.append(statistics.median(trips) if trips else 0.0)
    small, large = costs
    alpha = small / 2
    return alpha, max(0.0, (large / 2 - alpha) / big), small


def worker(shape, dp, repeats, result_path):
    from patches.profiler import PipelineFlopsProfiler
    from patches.profiler.context import RunDescription

    args = init(shape, dp)
    engine, step = build_pipeline_engine(args)
    step()  # warm-up
    profiler = PipelineFlopsProfiler(engine, RunDescription(seq_length=args.seq_length))
    profiler.start_profile()
    step()
    profiler.stop_profile()
    measured = {"former": [], "current": []}
    for _ in range(repeats):
        for design in ("former", "current"):
            profiler._source.forget()  # build it again, by this design
            get = (lambda: former_get_report(profiler, args.seq_length)) if design == "former" else profiler.get_report
            with counting(ByteCounter()) as counter:
                seconds, report = timed(get)
            measured[design].append((seconds, counter.received))
    alpha, beta, trip = link_costs() if dist.get_world_size() > 1 else (0.0, 0.0, 0.0)
    mine = {design: max(received for _, received in runs) for design, runs in measured.items()}
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    if dist.get_rank() == 0:
        row = {"dp": dp, "world": dist.get_world_size(), "alpha": alpha, "beta": beta, "trip": trip,
               "report": profiler.get_report(), "entries": profiler._source._entries,
               # as the collectives pickle them (a JSON round trip would change the pickled size)
               "entry_bytes": max(len(pickle.dumps(e)) for e in profiler._source._entries)}
        for design in measured:
            row[f"{design}_s"] = statistics.median(seconds for seconds, _ in measured[design])
            row[f"{design}_bytes"] = [ranks[design] for ranks in everyone]
        with open(result_path, "w") as f:
            json.dump(row, f)
    dist.barrier()
    profiler.end_profile()


# ---------------------------------------------------------------- simulation
def replicated(entries, dp):
    """Every rank's entry for pp x dp ranks: replica 0's recorded entries, renumbered per replica."""
    out = []
    for e in entries:
        for d in range(dp):
            out.append(dict(e, dp_rank=d, global_rank=e["stage_id"] * dp + d))
    return out


def simulate(row, world, link):
    """Bytes and seconds of both designs at `world` ranks (pp 2, tp 1) from a real run's entries and the
    link costs (alpha, beta, trip) of another."""
    from patches.profiler.report import build_report
    from patches.profiler.stragglers import SAMPLE_BYTES, RankSample

    dp = world // PP
    alpha, beta, trip = link
    context = _context(row["report"], dp)
    entries = replicated(row["entries"], dp)
    replica = [e for e in entries if e["dp_rank"] == 0]
    blobs = [pickle.dumps(e) for e in entries]
    entry_bytes = row["entry_bytes"]

    start = time.perf_counter()
    former_entries = [pickle.loads(b) for b in blobs]
    build_report(former_entries, context)
    former_build = time.perf_counter() - start
    # ring all-gather of the sizes, then of the padded entries; (world - 1) sequential rounds of pings
    former_comm = 2 * (world - 1) * alpha + (world - 1) * (8 + entry_bytes) * beta + (world - 1) * CLOCK_ROUNDS * trip
    former_bytes = (world - 1) * (entry_bytes + 8) + CLOCK_ROUNDS * 8

    samples = [RankSample.from_entry(e) for e in entries]
    raw = [s.to_bytes() for s in samples]
    start = time.perf_counter()
    current_samples = [RankSample.from_bytes(b) for b in raw]
    stage_entries = [pickle.loads(pickle.dumps(e)) for e in replica]
    report = build_report(stage_entries, context, current_samples)
    report_bytes = len(pickle.dumps(report))
    current_build = time.perf_counter() - start
    current_comm = ((PP - 1) * CLOCK_ROUNDS * trip  # the replica's other rank pings rank 0
                    + (PP - 1) * (2 * alpha + (8 + entry_bytes) * beta)  # leaders: sizes, then entries
                    + (world - 1) * (alpha + SAMPLE_BYTES * beta)  # samples, received in turn at rank 0
                    + math.ceil(math.log2(world)) * (2 * alpha + (8 + report_bytes) * beta))  # binomial broadcast
    # the most a non-zero rank receives: stage 1's leader (pings, gather sizes, the report)
    current_bytes = CLOCK_ROUNDS * 8 + (PP - 1) * 8 + 8 + report_bytes
    return {"world": world, "dp": dp, "former_bytes": former_bytes, "current_bytes": current_bytes,
            "former_s": former_comm + former_build, "current_s": current_comm + current_build,
            "former_build_s": former_build, "current_build_s": current_build}


def _context(report, dp):
    """The context of a real run's report, at dp replicas."""
    from patches.profiler.context import ReportContext, RunDescription

    par = report["parallelism"]
    return ReportContext(report["step"], PP * dp, PP, 1, dp, par["micro_batches"], par["micro_batch_size"],
                         report["activation_checkpointing"], "cpu", "fp32", None,
                         RunDescription(seq_length=par["seq_length"]))


# ---------------------------------------------------------------- printing
def kib(n):
    return f"{n / 1024:.1f}"


def ms(seconds):
    return f"{seconds * 1000:.1f}"


def nonzero_max(received):
    return max(received[1:]) if len(received) > 1 else 0


def print_real(rows, link):
    headers = ["dp", "ranks", "former KiB to a non-zero rank", "(modelled)", "current KiB", "(modelled)",
               "former KiB to rank 0", "current KiB to rank 0", "former ms", "current ms"]
    lines = []
    for r in rows:
        model = simulate(r, r["world"], link)  # the simulation's byte count at a size that was measured
        lines.append([r["dp"], r["world"], kib(nonzero_max(r["former_bytes"])), kib(model["former_bytes"]),
                      kib(nonzero_max(r["current_bytes"])), kib(model["current_bytes"]), kib(r["former_bytes"][0]),
                      kib(r["current_bytes"][0]), ms(r["former_s"]), ms(r["current_s"])])
    print(table(headers, lines))


def print_simulated(rows):
    headers = ["dp", "ranks", "former KiB to a non-zero rank", "current KiB", "former s", "current s",
               "former build s", "current build s"]
    print(table(headers, [[r["dp"], r["world"], kib(r["former_bytes"]), kib(r["current_bytes"]),
                           f"{r['former_s']:.3f}", f"{r['current_s']:.3f}", f"{r['former_build_s']:.3f}",
                           f"{r['current_build_s']:.3f}"] for r in rows]))


def plot(real, simulated, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for design, style, color in (("former", "o", "tab:red"), ("current", "s", "tab:blue")):
        for axis, key in ((left, "bytes"), (right, "s")):
            real_values = [nonzero_max(r[f"{design}_bytes"]) if key == "bytes" else r[f"{design}_s"] for r in real]
            axis.plot([r["world"] for r in real], real_values, style + "-", color=color, label=f"{design}, real")
            axis.plot([r["world"] for r in simulated], [r[f"{design}_{key}"] for r in simulated], style + "--",
                      color=color, mfc="none", label=f"{design}, simulated")
    for axis, label in ((left, "bytes received by a non-zero rank (most)"), (right, "get_report seconds")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("ranks (pp 2 x dp)")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle("Getting the profile report: former (world all-gather) vs current (replica gather + broadcast)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiniest GPT, dp 1 and 2 (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3, help="reports per design and point (default 3; medians)")
    parser.add_argument("--plot", default=None, help="also write the figures to this PNG")
    options = parser.parse_args()
    shape = dict(TINY if options.quick else SHAPE)
    dps = QUICK_DPS if options.quick else DPS
    repeats = 1 if options.quick else options.repeats
    print(f"machine: {machine()}")
    print(f"config: pp {PP}, hidden {shape['hidden']}, {shape['layers']} layers, sequence {shape['seq']}, "
          f"{shape['micro_batches']} micro-batches of {shape['micro_batch']} per replica, fp32", flush=True)
    real = []
    with tempfile.TemporaryDirectory() as tmp:
        for dp in dps:
            path = os.path.join(tmp, f"dp{dp}.json")
            spawn(worker, PP * dp, shape, dp, repeats, path)
            with open(path) as f:
                real.append(json.load(f))
    # The link costs of the smallest run: the larger ones put up to 16 ranks on 2 cores, whose waits
    # for a core would pass for network latency.
    largest, smallest = max(real, key=lambda r: r["world"]), min(real, key=lambda r: r["world"])
    link = (smallest["alpha"], smallest["beta"], smallest["trip"])
    print("\nreal runs (bytes: payload delivered by the collectives to the rank, and the simulation's count for "
          "the same size; ms: slowest rank, medians):")
    print_real(real, link)
    print(f"link costs measured at {smallest['world']} ranks: alpha {link[0] * 1e6:.1f} us per message, "
          f"beta {link[1] * 1e9:.3f} ns per byte, round trip of 8 bytes {link[2] * 1e6:.1f} us")
    simulated = [simulate(largest, world, link) for world in SIMULATED_WORLDS]
    print("\nsimulated from that run's entries (collectives modelled from the link costs; unpickling and "
          "building done for real):")
    print_simulated(simulated)
    if options.plot:
        plot(real, simulated, options.plot)
        print(f"\nplot written to {options.plot}")
    print(f"at the end: {load()}")
    by_dp = {r["dp"]: nonzero_max(r["current_bytes"]) for r in real}
    if 8 in by_dp:
        ratio, source = by_dp[8] / by_dp[1], "real runs"
    else:  # --quick: dp 8 was not run; the same count for pp 2 x dp 8 from the model, against the real dp 1
        ratio, source = simulate(largest, PP * 8, link)["current_bytes"] / by_dp[1], "dp 8 modelled, dp 1 real"
    print(f"({source}; the former design: "
          f"{(nonzero_max(largest['former_bytes']) / max(1, nonzero_max(real[0]['former_bytes']))):.2f} "
          f"at dp {largest['dp']} over dp 1)")
    print(f"report bytes received by a non-zero rank, dp 8 over dp 1: {ratio:.2f}")


if __name__ == "__main__":
    sys.exit(main())
