"""The elastic driver: runs an elastic job's workers through rounds of membership.

A round is formed when every slot chosen for it has a live worker that asked to join (surviving
workers after leaving the previous round, new processes once they reach ``hvd.init()``); only
then is it published, so all members set up their data plane together. A round ends when a
member leaves it (its collectives failed, or hosts changed at a commit) or dies. Then:

- a worker that failed (non-zero exit) blacklists its host; the other workers live on;
- a member that does not leave a broken round within the leave timeout (frozen, stuck in I/O)
  is stopped and treated as failed, as is one its peers reported as making no progress;
- the next round takes the usable hosts in their stable order, at most ``max_np`` workers and
  at least ``min_np`` (waiting up to the elastic timeout for enough), and needs a survivor of
  the previous round to hand over the training state (waiting up to the elastic timeout too
  while survivors live on hosts that discovery stopped listing: a discovery glitch);
- more than ``reset_limit`` new rounds, no hosts left, no survivor, or every worker failed ends
  the job with a message that says which, followed by each failure's last output lines.

The job is done when a member of the current round exits with status 0; the others finish too.

Must not touch: the training runtime (workers learn their ranks through the store).
"""

from __future__ import annotations

import itertools
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from horovod.rendezvous import elastic as protocol
from horovod.rendezvous.server import RendezvousServer
from horovod.runner.elastic.discovery import DiscoveryError
from horovod.runner.elastic.membership import HostBook, change, host_of, seats
from horovod.runner.elastic.workers import Launcher
from horovod.runner.hosts import HostInfo

POLL_S = 0.02
DISCOVER_EVERY_S = 1.0

# How messages name the job's settings: horovodrun's flags by default; Ray and Spark pass the
# names of their own arguments.
CLI_NAMES = {
    "label": "horovodrun",
    "min_np": "--min-np/-np",
    "elastic_timeout": "--elastic-timeout",
    "reset_limit": "--reset-limit",
    "cooldown": "--blacklist-cooldown-range",
    "add_hosts": "Add hosts (check the discovery script's output)",
}


@dataclass
class Failure:
    slot: str
    rank: int
    what: str
    when: float
    tail: list[str]


class ElasticDriver:
    def __init__(
        self,
        discovery: object,
        *,
        server: RendezvousServer,
        launcher: Launcher,
        np: int,
        min_np: int,
        max_np: int | None,
        reset_limit: int | None,
        cooldown: tuple[float, float] | None,
        elastic_timeout: float,
        start_timeout: float,
        leave_timeout: float,
        grace: float,
        verbose: bool = False,
        discover_every: float = DISCOVER_EVERY_S,
        names: dict[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.discovery = discovery
        self.server = server
        self.launcher = launcher
        self.np, self.min_np, self.max_np = np, min_np, max_np
        self.reset_limit = reset_limit
        self.elastic_timeout = elastic_timeout
        self.start_timeout = start_timeout
        self.leave_timeout = leave_timeout
        self.grace = grace
        self.verbose = verbose
        self.discover_every = discover_every
        self.names = {**CLI_NAMES, **(names or {})}
        self.clock = clock
        self.book = HostBook(cooldown, clock)
        self.exits: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.workers: dict[str, Any] = {}  # slot -> its live process
        self.ids: dict[int, str] = {}  # id(worker) -> worker id
        self.started: dict[int, float] = {}  # id(worker) -> when started (new processes)
        self.wids = itertools.count()
        self.generation = -1
        self.members: dict[str, protocol.Seat] = {}
        self.update_id = 0
        self.wanted: dict[str, protocol.Seat] = {}  # the next round, as things stand
        self.announced: set[str] = set()  # the membership the last host update announced
        self.broken_at: float | None = None
        self.forming_since: float | None = None
        self.awaiting_survivors = False  # (warned that discovery lost the survivors' hosts)
        self.resets = 0
        self.failures: list[Failure] = []
        self.finished_by: str | None = None
        self.error: str | None = None
        self.interrupted: str | None = None
        self.all_workers: list[Any] = []
        self._discovered: list[HostInfo] | None = None
        self._discover_lock = threading.Lock()
        self._stop = threading.Event()

    # ------------------------------------------------------------------ discovery
    def _discover_loop(self) -> None:
        while not self._stop.wait(self.discover_every):
            try:
                hosts = self.discovery.find()  # type: ignore[attr-defined]
            except DiscoveryError as e:  # only raised before the first success
                print(f"{self.names['label']}: {e}", file=sys.stderr)
                continue
            with self._discover_lock:
                self._discovered = hosts

    def _apply_discovery(self) -> None:
        with self._discover_lock:
            found, self._discovered = self._discovered, None
        if found is not None:
            self.book.update(found)
        self._plan_next()
        if self.generation < 0 or self.finished_by is not None:
            return
        flags = change(self.members, self.wanted)
        if flags and set(self.wanted) != self.announced:
            self.announced = set(self.wanted)
            self.update_id += 1
            self.server.put(protocol.SCOPE, "update", protocol.encode_update(self.update_id, flags))
            self._say(
                "hosts changed: the next round would be "
                + (", ".join(self._hosts_text(self.wanted)) or "empty")
            )

    def _plan_next(self) -> None:
        self.wanted = seats(self.book.plan(self._alive_members()), self.max_np)

    def _alive_members(self) -> list[str]:
        return [s for s in self.members if s in self.workers and not self.workers[s].stopped_by_us]

    @staticmethod
    def _hosts_text(slots: dict[str, protocol.Seat]) -> list[str]:
        count: dict[str, int] = {}
        for s in slots:
            count[host_of(s)] = count.get(host_of(s), 0) + 1
        return [f"{h}:{n}" for h, n in count.items()]

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        self.book.update(self.discovery.find())  # type: ignore[attr-defined]
        discover = threading.Thread(target=self._discover_loop, name="discovery", daemon=True)
        discover.start()
        try:
            while True:
                self._apply_discovery()
                self._reap()
                self._read_suspects()
                self._read_leavers()
                if self.interrupted is not None:
                    break
                if self.finished_by is not None:
                    self._stop_non_members()
                    if not self.workers:
                        break
                elif self.error is None and (self.generation < 0 or self.broken_at is not None):
                    self._form()
                if self.error is not None:
                    break
                time.sleep(POLL_S)
        finally:
            self._stop.set()
        if self.error is not None or self.interrupted is not None:
            self.launcher.stop(list(self.workers.values()), self.grace)
            deadline = self.clock() + self.grace + 5
            while self.workers and self.clock() < deadline:
                self._reap()
                time.sleep(POLL_S)
        for w in self.all_workers:
            for t in w.threads:
                t.join(2)
        self.launcher.close()
        if self.interrupted is not None:
            return 130 if self.interrupted == "SIGINT" else 143
        return 1 if self.error is not None else 0

    def interrupt(self, signame: str) -> None:
        self.interrupted = self.interrupted or signame

    def abort(self, why: str) -> None:
        """End the job as failed (from another thread: the engine running the workers
        failed, so no round can form); its workers are stopped."""
        self.error = self.error or why

    # ------------------------------------------------------------------ events
    def _reap(self) -> None:
        while True:
            try:
                w = self.exits.get_nowait()
            except queue.Empty:
                return
            slot = self._slot_of(w)
            if slot is not None and self.workers.get(slot) is w:
                del self.workers[slot]
            member = slot is not None and slot in self.members and not w.stopped_by_us
            if w.exit_code == 0:
                if member and self.broken_at is None and self.finished_by is None:
                    self.finished_by = slot
                    self._say(f"rank {w.rank} ({slot}) finished: the job is done")
                continue
            if w.stopped_by_us or slot is None:
                continue
            self._failed(w, slot, self.launcher.describe(w))

    def _failed(self, w: Any, slot: str, what: str) -> None:
        self.failures.append(Failure(slot, w.rank, what, time.time(), list(w.tail)))
        self.book.blacklist(host_of(slot), what)
        self._say(f"rank {w.rank} ({slot}) {what}; blacklisting host {host_of(slot)}")
        if slot in self.members:
            self._break()

    def _break(self) -> None:
        if self.broken_at is None:
            self.broken_at = self.clock()
            # Members still setting up the round's data plane stop waiting for the lost one.
            self.server.put(protocol.SCOPE, f"broken.{self.generation}", b"1")

    def _read_suspects(self) -> None:
        """Ranks a worker reported as making no progress: stop them (they count as failed)."""
        by_rank = {seat.rank: slot for slot, seat in self.members.items()}
        for slot in list(self.members):
            raw = self.server.get(protocol.SCOPE, f"suspect.{slot}")
            if not raw:
                continue
            self.server.put(protocol.SCOPE, f"suspect.{slot}", b"")
            for text in raw.decode().split():
                target = by_rank.get(int(text))
                if target is None:
                    continue
                w = self.workers.get(target)
                if w is not None and not w.stopped_by_us:
                    self._stop_failed(w, target, "made no progress (reported by its peers)")

    def _stop_failed(self, w: Any, slot: str, what: str) -> None:
        self.launcher.stop([w], 0.0, signal.SIGKILL)
        self._failed(w, slot, what)

    def _read_leavers(self) -> None:
        """Members that left the current round (their collectives failed, or hosts changed)."""
        if self.generation < 0:
            return
        for slot in self.members:
            w = self.workers.get(slot)
            if w is not None and self._ready_for(slot, w) == self.generation:
                self._break()
                return

    def _ready_for(self, slot: str, w: Any) -> int | None:
        """The round after which ``w`` asked to join, if it asked (None otherwise)."""
        got = protocol.read_ready(self.server.get(protocol.SCOPE, f"ready.{slot}"))
        if got is None or got[1] != self.ids.get(id(w)):
            return None
        return got[0]

    # ------------------------------------------------------------------ forming a round
    def _form(self) -> None:
        now = self.clock()
        if self.forming_since is None:
            self.forming_since = now
        target = self.generation + 1
        self._plan_next()
        wanted = self.wanted
        need = self.np if self.generation < 0 else self.min_np
        if self.generation >= 0 and not any(s in self.members for s in wanted):
            self._await_survivors(now - self.forming_since)
            return
        if len(wanted) < need:
            if self.book.all_blacklisted_for_good() and not self._may_grow():
                self.error = (
                    "every host is blacklisted after failures, and no cooldown was set "
                    f"({self.names['cooldown']}) to let them back"
                )
            elif now - self.forming_since > self.elastic_timeout:
                self.error = (
                    f"Timed out after {self.elastic_timeout:g} s waiting for the minimum number "
                    f"of slots: {len(wanted)} usable, {need} needed ({self.names['min_np']}). "
                    f"{self.names['add_hosts']} or raise {self.names['elastic_timeout']}."
                )
            return
        # Members of the broken round that do not leave it in time are lost (frozen, stuck).
        if self.broken_at is not None and now - self.broken_at > self.leave_timeout:
            for slot in list(self.members):
                w = self.workers.get(slot)
                if w is not None and self._ready_for(slot, w) != self.generation:
                    self._stop_failed(
                        w,
                        slot,
                        f"did not leave round {self.generation} within {self.leave_timeout:g} s "
                        "of it ending (frozen or stuck outside Horovod)",
                    )
            return
        # Processes for new slots, and for slots whose process is gone.
        for slot, seat in wanted.items():
            if slot not in self.workers:
                self._start(slot, seat, target)
        # New processes that do not reach hvd.init() in time count as failed.
        for slot in wanted:
            w = self.workers[slot]
            since = self.started.get(id(w))
            if (
                since is not None
                and now - since > self.start_timeout
                and self._ready_for(slot, w) is None
            ):
                self._stop_failed(
                    w, slot, f"did not reach hvd.init() within {self.start_timeout:g} s"
                )
                return
        if any(self._ready_for(s, self.workers[s]) != target - 1 for s in wanted):
            return
        if self.generation >= 0:
            self.resets += 1
            if self.reset_limit is not None and self.resets > self.reset_limit:
                self.error = (
                    f"the job was reset {self.resets} times, more than {self.names['reset_limit']} "
                    f"{self.reset_limit} allows"
                )
                return
        rnd = protocol.Round(target, wanted, self.update_id)
        protocol.publish_round(self.server, rnd)
        self.generation, self.members = target, wanted
        self.announced = set(wanted)
        self.broken_at = self.forming_since = None
        if self.awaiting_survivors:
            self.awaiting_survivors = False
            print(
                f"{self.names['label']}: elastic: host discovery lists the workers' hosts "
                f"again; round {target} goes on with them",
                file=sys.stderr,
                flush=True,
            )
        for slot, seat in wanted.items():
            w = self.workers[slot]
            w.rank = seat.rank
            self.started.pop(id(w), None)
        self._say(f"round {target}: {len(wanted)} workers on {', '.join(self._hosts_text(wanted))}")

    def _await_survivors(self, waited: float) -> None:
        """(Forming a round that no worker of the last one would be in.) The training state
        lives only in those workers. If none is alive, the job cannot go on. If some are, but
        discovery no longer lists their hosts (a discovery script that printed nothing once,
        a cloud API that timed out), wait for the hosts to come back, as long as the elastic
        timeout allows, as upstream waits for slots before it checks for a survivor."""
        alive = self._alive_members()
        if not alive:
            self.error = (
                f"no worker of round {self.generation} is left to hand over the training "
                "state (every one failed or was stopped); the job cannot go on"
            )
            return
        hosts = ", ".join(dict.fromkeys(host_of(s) for s in alive))
        if waited > self.elastic_timeout:
            self.error = (
                f"host discovery has not listed {hosts} for {self.elastic_timeout:g} s, and "
                f"the training state lives only in the workers of round {self.generation} "
                f"there ({len(alive)} alive); the job cannot go on without them. Check the "
                f"discovery script's output, or raise {self.names['elastic_timeout']}"
            )
        elif not self.awaiting_survivors:
            print(
                f"{self.names['label']}: elastic: warning: host discovery no longer lists "
                f"{hosts}, where the workers of round {self.generation} that hold the training "
                f"state run; waiting up to {self.elastic_timeout:g} s "
                f"({self.names['elastic_timeout']}) for it to list them again",
                file=sys.stderr,
                flush=True,
            )
        self.awaiting_survivors = True

    def _may_grow(self) -> bool:
        return self.book.next_resurrection() is not None

    def _start(self, slot: str, seat: protocol.Seat, target: int) -> None:
        wid = f"{next(self.wids)}"
        env = {
            "HOROVOD_ELASTIC": "1",
            "HOROVOD_ELASTIC_SLOT": slot,
            "HOROVOD_ELASTIC_ROUND": str(target),
            "HOROVOD_ELASTIC_WORKER_ID": wid,
            "HOROVOD_HOSTNAME": host_of(slot),
            **seat.env(),
        }
        w = self.launcher.start(host_of(slot), seat.rank, env, self.exits)
        self.workers[slot] = w
        self.ids[id(w)] = wid
        self.started[id(w)] = self.clock()
        self.all_workers.append(w)

    def _stop_non_members(self) -> None:
        """After the job finished: workers waiting to join a round that will not come."""
        idle = [w for s, w in self.workers.items() if s not in self.members]
        idle += [
            w
            for s, w in self.workers.items()
            if s in self.members and self._ready_for(s, w) == self.generation
        ]
        self.launcher.stop([w for w in idle if not w.stopped_by_us], self.grace)

    def _slot_of(self, w: Any) -> str | None:
        for slot, live in self.workers.items():
            if live is w:
                return slot
        return None

    def _say(self, text: str) -> None:
        if self.verbose:
            print(f"{self.names['label']}: elastic: {text}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ report
    def report(self) -> str:
        if self.interrupted is not None:
            return f"{self.names['label']}: received {self.interrupted}; stopped all workers."
        lines = []
        if self.error is not None:
            lines += ["", f"{self.names['label']}: the elastic job failed: {self.error}."]
        elif self.failures:
            lines += [
                "",
                f"{self.names['label']}: the elastic job finished after {len(self.failures)} worker "
                f"failure(s) and {self.resets} reset(s).",
            ]
        if self.failures:
            lines.append("Worker failures, in order:")
            for f in self.failures:
                when = time.strftime("%H:%M:%S", time.localtime(f.when))
                lines.append(f"  {when} rank {f.rank} ({f.slot}) {f.what}")
            last = self.failures[-1]
            if last.tail and self.error is not None:
                lines.append(f"Last lines of rank {last.rank} ({last.slot}):")
                lines.extend(f"  {t}" for t in last.tail)
        return "\n".join(lines)
