"""Which rank failed: heartbeats and exit records in the rendezvous store, read when a run breaks.

When one rank dies, the others only see a broken connection ("Connection closed by peer") or a
collective timing out, and the deepspeed launcher then terminates the other ranks of that node.
None of that names the rank that failed. So every rank
- bumps a heartbeat counter in the rendezvous store (the TCPStore at MASTER_ADDR:MASTER_PORT, which
  lives in global rank 0's process) every HEARTBEAT_S, from a daemon thread;
- when an error escapes training, or on SIGTERM (its launcher stopping it), writes an exit record
  numbered by a store counter, so records are globally ordered;
- then names the rank that failed first: a rank whose heartbeat stopped for GRACE_S without a record
  was killed (SIGKILL, out of memory, node lost); otherwise the rank with the first error record.
  The first rank to conclude stores the verdict; the others reuse it, and the heartbeat threads keep
  a copy in case rank 0, and the store with it, exits next. Where a collective already told every
  rank who failed (the profile report's gather), that word is used, on the failing ranks too, so
  they need no store to say so; rank 0 waits for them to report before it takes the store down.
- A rank whose heartbeat thread sees a verdict ends at once, even with its main thread blocked in a
  collective that would only time out (NCCL does not notice a dead peer).
Every rank prints one line saying why it stops, then exits non-zero.

SIGTERM reaches the heartbeat thread through signal.set_wakeup_fd, so a rank blocked inside a
collective still reports and exits at once, as it would without a handler. A rank stopped by SIGTERM when no
rank has failed (the job ended from outside: DeepSpeed's launcher ends its ranks one after the other) leaves
that as the verdict, so the others stop at once and say so instead of blaming the rank whose store went away.
"""
import atexit
import os
import re
import select
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

HEARTBEAT_S = 0.5
GRACE_S = 2.5  # five missed heartbeats: the rank is gone
EXIT_FAILED = 1
EXIT_TERMINATED = 128 + signal.SIGTERM
_PREFIX = "megatron/liveness/"
_VERDICT = _PREFIX + "verdict"
_SILENT = "no heartbeat"  # how a verdict on a killed rank starts: that rank will never report
_STOPPED = "stopped by SIGTERM"  # how a verdict starts where no rank failed
_ENDED_FROM_OUTSIDE = "the job was ended from outside, no rank failed"

_monitor = None


def start(rank, world_size):
    """Start this rank's heartbeat once torch.distributed is up; nothing without a rendezvous store."""
    global _monitor
    if _monitor is None and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        _monitor = Liveness(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world_size)
    return _monitor


def exit_after_failure(error, iteration=None):
    """Print why this rank stops, naming the rank that failed first, and exit 1 (re-raise when not started)."""
    if _monitor is None:
        raise error
    _monitor.fail(error, iteration)


class Liveness:
    def __init__(self, host, port, rank, world_size):
        self.address = f"{host}:{port}"
        self.rank = rank
        self.world_size = world_size
        self.store = self._connect(host, port)  # used by whichever thread is ending the rank
        self._beat_store = self._connect(host, port)  # the heartbeat thread's own connection
        self._cached_verdict = None
        self._ending = threading.Lock()
        self._stopping = threading.Event()
        self._wakeup_read, self._wakeup_write = os.pipe()
        os.set_blocking(self._wakeup_write, False)
        signal.set_wakeup_fd(self._wakeup_write, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, lambda signum, frame: self.terminate())
        self._thread = threading.Thread(target=self._beat, name="megatron-liveness", daemon=True)
        self._thread.start()
        atexit.register(self._stop)

    def _stop(self):
        """A normal exit: end the heartbeat thread before the interpreter tears its store client down."""
        self._record("exited", "")  # its heartbeat stops now: gone, but not failed
        self._stopping.set()
        try:
            os.write(self._wakeup_write, b"\0")
        except BlockingIOError:  # the pipe is full: the thread is awake anyway
            pass
        self._thread.join(timeout=5 * HEARTBEAT_S)

    @staticmethod
    def _connect(host, port):
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)

    # ------------------------------------------------------------------ this rank ends
    def fail(self, error, iteration):
        """An error escaped training on this rank."""
        if not self._ending.acquire(blocking=False):
            while True:  # the heartbeat thread is already ending this rank (SIGTERM, a verdict) and will exit
                time.sleep(3600)
        where = f" in iteration {iteration}" if iteration is not None else ""
        summary = f"{type(error).__name__}: {_first_sentence(str(error))}"
        named = getattr(error, "failed_ranks", None)
        if named and self.rank not in named:
            # A collective told every rank who failed (the profile report's gather): no guessing.
            self._record("stopped", summary + where)
            self._store_verdict(named, error.reason)  # for a rank the launcher stops before its own error reaches it
            self._finish(f"error: rank {self.rank} stops{where}: {_blame(named, error.reason)}", named, error.reason,
                         EXIT_FAILED)
        self._record("error", summary + where)
        if named:
            # This rank is among those the collective named: it knows it failed without the store,
            # which rank 0 may already have taken down with it.
            culprits, reason = named, error.reason
            self._store_verdict(culprits, reason)
        else:
            # An error of its own (not a broken connection) is this rank's failure even where rank 0, and
            # the store with it, is gone by now: only a lost peer says nothing about who failed.
            own = None if _is_lost_peer(error) else summary + where
            culprits, reason = self._first_failure(own)
        if named or culprits == [self.rank]:
            traceback.print_exception(type(error), error, error.__traceback__)
            message = f"error: rank {self.rank} failed{where}: {summary}"
        else:
            message = f"error: rank {self.rank} stops{where}: {_blame(culprits, reason)}; here: {summary}"
        self._finish(message, culprits, reason, EXIT_TERMINATED if reason.startswith(_STOPPED) else EXIT_FAILED)

    def terminate(self):
        """SIGTERM: the launcher ends this node's ranks because one of them exited."""
        if not self._ending.acquire(blocking=False):
            return
        self._record("stopped", "stopped by SIGTERM")
        culprits, reason = self._first_failure()
        if not culprits and self._none_left():
            # No rank failed or left: the job is being ended from outside, and the others may stop now instead of
            # blaming this rank once its store is gone. (A verdict another rank stored meanwhile stands.)
            culprits, reason = self._store_verdict([self.rank], f"{_STOPPED}: {_ENDED_FROM_OUTSIDE}")
        message = f"error: rank {self.rank} {_STOPPED}"
        if reason.startswith(_STOPPED):
            message += f": {_ENDED_FROM_OUTSIDE}"
        elif culprits:
            message += f": {_blame(culprits, reason)}"
        self._finish(message, culprits, reason, EXIT_TERMINATED)

    def follow(self, verdict):
        """Another rank named the failure: end this one now, wherever its main thread is."""
        if not self._ending.acquire(blocking=False):
            return
        self._record("stopped", "stopped after another rank's failure")
        culprits, reason = verdict
        code = EXIT_TERMINATED if reason.startswith(_STOPPED) else EXIT_FAILED
        self._finish(f"error: rank {self.rank} stops: {_blame(culprits, reason)}", culprits, reason, code)

    def _finish(self, message, culprits, reason, code):
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        self._record("reported", "")
        if self.rank == 0:
            # A rank that raised is alive and will report; only a silent one is gone for good.
            gone = culprits if reason.startswith(_SILENT) else []
            self._linger(expected=self.world_size - len(gone))
        os._exit(code)  # no interpreter teardown: destroying process groups with dead peers can hang

    # ------------------------------------------------------------------ the store
    def _beat(self):
        key = f"{_PREFIX}heartbeat/{self.rank}"
        while True:
            ready, _, _ = select.select([self._wakeup_read], [], [], HEARTBEAT_S)
            if ready and signal.SIGTERM in os.read(self._wakeup_read, 64):
                self.terminate()
            if self._stopping.is_set():
                return
            try:
                self._beat_store.add(key, 1)
                if self._cached_verdict is None and self._beat_store.check([_VERDICT]):
                    self._cached_verdict = _decode_verdict(self._beat_store.get(_VERDICT))
            except Exception:  # the store's host, rank 0, is gone; whoever ends this rank says so
                time.sleep(HEARTBEAT_S)
            if self._cached_verdict is not None:
                self.follow(self._cached_verdict)

    def _record(self, kind, text):
        try:
            number = self.store.add(f"{_PREFIX}sequence", 1)
            self.store.set(f"{_PREFIX}{kind}/{self.rank}", f"{number}|{text}")
        except Exception:
            pass

    def _store_verdict(self, culprits, reason):
        """Best effort: the first verdict stays, and a store already gone changes nothing. Returns the verdict that
        stands: (culprits, reason), or the one another rank stored first."""
        try:
            return _decode_verdict(self.store.compare_set(_VERDICT, "", _encode_verdict(culprits, reason)))
        except Exception:
            return culprits, reason

    def _none_left(self):
        """Whether no rank has left a record of ending (a normal exit included: a rank that exits 2 on bad input
        leaves through the interpreter's exit, and the launcher then stops the others); False when the store is gone."""
        try:
            return not any(self._records(kind) for kind in ("error", "exited"))
        except Exception:
            return False

    def _records(self, kind):
        """{rank: (sequence number, text)} of the ranks that left a `kind` record."""
        found = {}
        for rank in range(self.world_size):
            key = f"{_PREFIX}{kind}/{rank}"
            if self.store.check([key]):
                number, text = self.store.get(key).decode().split("|", 1)
                found[rank] = (int(number), text)
        return found

    def _heartbeats(self):
        return [self.store.add(f"{_PREFIX}heartbeat/{rank}", 0) for rank in range(self.world_size)]

    def _first_failure(self, own=None):
        """(ranks, reason) of the first failure: the stored verdict, or this rank's own diagnosis. own: this
        rank's own error, where it raised one that is not a lost peer: the verdict when the store is gone."""
        try:
            if self.store.check([_VERDICT]):
                return _decode_verdict(self.store.get(_VERDICT))
            culprits, reason = self._diagnose()
            if culprits:
                self.store.set(_VERDICT, _encode_verdict(culprits, reason))
            return culprits, reason
        except Exception:
            if self._cached_verdict is not None:
                return self._cached_verdict
            if own is not None:
                return [self.rank], own
            if self.rank == 0:
                return [], ""
            return [0], f"the rendezvous store it hosts at {self.address} stopped answering: its process ended"

    def _diagnose(self):
        before = self._heartbeats()
        deadline = time.monotonic() + GRACE_S
        while True:
            time.sleep(HEARTBEAT_S / 2)
            now = self._heartbeats()
            left = set(self._records("error")) | set(self._records("stopped")) | set(self._records("exited"))
            silent = [r for r in range(self.world_size) if r not in left and now[r] == before[r]]
            if not silent or time.monotonic() >= deadline:
                break
        if silent:
            return silent, (f"{_SILENT} for {GRACE_S:.1f} s and no error recorded: killed by a signal, "
                            f"out of memory, or its node went down")
        errors = sorted((number, rank, text) for rank, (number, text) in self._records("error").items())
        if errors:
            _, rank, text = errors[0]
            return [rank], text
        return [], ""

    def _linger(self, expected):
        """Rank 0 hosts the store: stay until `expected` ranks have reported (2 heartbeats to GRACE_S + 1 s)."""
        start = time.monotonic()
        try:
            while time.monotonic() < start + GRACE_S + 1.0:
                if time.monotonic() >= start + 2 * HEARTBEAT_S and len(self._records("reported")) >= expected:
                    return
                time.sleep(HEARTBEAT_S / 2)
        except Exception:
            pass


def _encode_verdict(culprits, reason):
    return ",".join(map(str, culprits)) + "|" + reason


def _decode_verdict(raw):
    ranks, reason = raw.decode().split("|", 1)
    return [int(r) for r in ranks.split(",")], reason


def _blame(culprits, reason):
    ranks = ("rank " if len(culprits) == 1 else "ranks ") + ", ".join(str(r) for r in culprits)
    if reason.startswith(_STOPPED):
        return f"{ranks} {reason}"
    return f"{ranks} failed first ({reason})" if culprits else "no rank is known to have failed first"


# How gloo and the store say that a peer went away (its process ended, its node was lost).
_LOST_PEER = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|Connection refused|"
                        r"timed out|Timed out|timeout", re.IGNORECASE)


def _is_lost_peer(error):
    """Whether the error only says that a peer is gone (a broken connection, a timeout), not why."""
    return isinstance(error, dist.DistError) or bool(_LOST_PEER.search(str(error)))


def _first_sentence(text):
    """Backend errors run long ("[file.cc:553] Connection closed by peer [addr]:port. This is typically ...")."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0] if text.strip() else "")
    return re.split(r"(?<=\.)\s", text, maxsplit=1)[0][:200]
