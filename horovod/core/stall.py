"""The stall inspector and hang doctor (on the coordinator, rank 0).

Owns: finding collectives that some ranks submitted and others did not for longer than
``HOROVOD_STALL_CHECK_TIME_SECONDS``, asking the ranks involved for their stacks, and writing
the report (who submitted where, who is missing and where it is, cross-set deadlocks, ranks
stuck in C code), fatal past ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``; the failure text of
collectives orphaned at shutdown; the periodic wait-attribution summary. It only reads the
coordinator's tables; it changes none of them (but for orphans, which it removes).

Must not touch: the negotiation tables beyond reading them; the job (it reports and, past the
limit, the engine aborts).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from typing import TYPE_CHECKING

from horovod.common.log import logger
from horovod.core.diagnose import (
    capture_stacks,
    format_stacks,
    main_stack,
    where,
)
from horovod.core.messages import (
    ERROR,
    Response,
    display_name,
    encode,
)
from horovod.core.pending import Built, Pending

if TYPE_CHECKING:
    from horovod.core.diagnose import WaitStats
    from horovod.core.engine_state import EngineState


STACK_WAIT_SECONDS = 2.0  # how long the hang doctor waits for ranks to send their stacks


def crossed_grace(stall_check: float) -> float:
    """How long two collectives of one user name but different kinds (rank 0's allgather
    'm', rank 1's allreduce 'm') may wait, each for exactly the ranks that called the other,
    before they are refused as a mismatch rather than left to the stall check (their core
    names differ, so they never meet): a tenth of HOROVOD_STALL_CHECK_TIME_SECONDS, from 0.5 to
    5 s. A program that uses one name for two kinds at once, submitting them in different
    orders on different ranks, meets well within that."""
    return min(5.0, max(0.5, stall_check / 10)) if stall_check > 0 else 5.0


class Stalled:
    """One collective the stall inspector found waiting for some ranks."""

    __slots__ = ("ps_id", "name", "p", "missing", "waited")

    def __init__(self, ps_id: int, name: str, p: Pending, missing: list[int], waited: float):
        self.ps_id, self.name, self.p, self.missing, self.waited = ps_id, name, p, missing, waited

    @property
    def what(self) -> str:
        first = next(iter(self.p.reqs.values()))
        on = f" on process set {self.ps_id}" if self.ps_id else ""
        return display_name(first.op, self.name) + on


class Diagnosis:
    """A stall report being assembled: the stacks asked of the ranks involved."""

    def __init__(
        self, token: int, stalled: list[Stalled], fatal: bool, asked: set[int], deadline: float
    ) -> None:
        self.token, self.stalled, self.fatal = token, stalled, fatal
        self.asked, self.deadline = asked, deadline
        self.stacks: dict[int, list] = {}


def ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


class StallInspector:
    """The stall-inspection part of the coordinator (see the module docstring)."""

    # What the inspector reads of the coordinator it is part of
    e: EngineState
    tables: dict[int, dict[str, Pending]]
    joined: dict[int, None]
    partial: int
    shutdown_why: str | None
    waits: WaitStats
    # Its own state (set up by the coordinator)
    stall_check: float
    stall_shutdown: float
    crossed_grace: float
    next_stall: float
    diagnosis: Diagnosis | None
    tokens: int

    def record_arrivals(self) -> None:  # (the coordinator's)
        raise NotImplementedError

    def report_waits(self, now: float) -> None:
        self.record_arrivals()
        text = self.waits.summary(now)
        if text is not None:
            logger.info(text)
            tl = self.e.timeline
            if tl is not None:
                tl.counter(
                    "WAITED_FOR_SLOWEST_RANK_S",
                    {f"rank {r}": round(w, 6) for r, w in enumerate(self.waits.waited)},
                )
        self.waits.reset(now)

    def _orphans(self) -> list[Built]:
        """At shutdown, collectives that only some ranks submitted can never run: fail them
        with a message that says so, rather than with a bare shutdown notice."""
        out: list[Built] = []
        for ps_id, table in self.tables.items():
            for name, p in list(table.items()):
                if p.ready or not p.reqs:
                    continue
                del table[name]
                self.partial -= 1
                st = Stalled(ps_id, name, p, [], 0.0)
                out.append(
                    (
                        Response(
                            ERROR,
                            ps_id,
                            [name],
                            error=(
                                f"{st.what} was submitted by {ranks_text(list(p.reqs))}"
                                f"{self._sites(p, {})} but {self.shutdown_why} without "
                                "submitting it, so it can never complete. Only some ranks "
                                "called this collective (for example inside `if hvd.rank() "
                                "== 0:`), or ranks called different numbers of collectives: "
                                "every rank of the process set must call it."
                            ),
                        ),
                        None,
                        None,
                    )
                )
        return out

    def _crossed(self, now: float) -> list[Built]:
        """Collectives under one user name but of different kinds, waiting longer than
        ``crossed_grace`` each for exactly the ranks that called another of them:
        every rank called one of them, so none can ever complete. Each is refused (removed,
        an ERROR response for its callers) with a message naming both calls."""
        groups: dict[tuple[int, str], list[tuple[str, Pending]]] = {}
        for ps_id, table in self.tables.items():
            for name, p in table.items():
                kind, _, user = name.partition(".")
                if user and not p.ready and p.reqs and now - p.t0 >= self.crossed_grace:
                    groups.setdefault((ps_id, user), []).append((name, p))
        out: list[Built] = []
        for (ps_id, user), pends in groups.items():
            ss = self.e.sets.get(ps_id)
            if len(pends) < 2 or ss is None:
                continue
            callers = [set(p.reqs) for _, p in pends]
            everyone = {r for r in ss.ranks if ps_id != 0 or r not in self.joined}
            if sum(map(len, callers)) != len(everyone) or set().union(*callers) != everyone:
                continue  # overlapping callers, or some rank has called none yet
            # (by lowest caller, not by which request arrived first: every run says the same)
            pends.sort(key=lambda item: min(item[1].reqs))
            calls = "; ".join(
                f"{ranks_text(sorted(p.reqs))} called {name.partition('.')[0]}{self._sites(p, {})}"
                for name, p in pends
            )
            text = (
                f"tensor '{user}': {calls}. Every rank must call the same collective for the "
                "same name (or give different collectives different names)"
            )
            for name, _ in pends:
                del self.tables[ps_id][name]
                self.partial -= 1
                out.append((Response(ERROR, ps_id, [name], error=text), None, None))
        return out

    def _unfinished(self, now: float) -> list[Stalled]:
        """Every collective some ranks submitted and others have not, oldest first."""
        out = []
        for ps_id, table in self.tables.items():
            ss = self.e.sets.get(ps_id)
            if ss is None:
                continue
            for name, p in table.items():
                if p.ready:
                    continue
                missing = [r for r in ss.ranks if r not in p.reqs and r not in self.joined]
                if missing:
                    out.append(Stalled(ps_id, name, p, missing, now - p.t0))
        out.sort(key=lambda st: st.p.t0)
        return out

    def _stalled(self, now: float) -> list[Stalled]:
        return [st for st in self._unfinished(now) if st.waited >= self.stall_check]

    def _stall_check(self, now: float) -> None:
        self.next_stall = now + self.stall_check
        if self.diagnosis is not None:
            return
        stalled = self._stalled(now)
        fatal = bool(self.stall_shutdown) and any(
            st.waited >= self.stall_shutdown for st in stalled
        )
        if not fatal and all(st.p.warned for st in stalled):
            return  # nothing new to say
        for st in stalled:
            st.p.warned = True
        # Ask every rank involved where it is; the report is written when they have answered.
        ranks = {r for st in stalled for r in (*st.p.reqs, *st.missing)}
        self.tokens += 1
        d = Diagnosis(self.tokens, stalled, fatal, ranks - {0}, now + STACK_WAIT_SECONDS)
        if 0 in ranks:
            d.stacks[0] = capture_stacks(self.e.main_ident, self.e.other_threads)
        wire = encode(("STACK?", d.token))
        for r in d.asked:
            try:
                self.e.transport.send_ctrl(r, wire)
            except Exception:
                pass
        self.diagnosis = d
        self._finish_diagnosis(now)

    def _finish_diagnosis(self, now: float) -> None:
        d = self.diagnosis
        assert d is not None
        if now < d.deadline and not d.asked <= set(d.stacks):
            return
        self.diagnosis = None
        silent = sorted(d.asked - set(d.stacks))
        dumped = []
        for r in silent:
            pid = self.e.stack_signal_pids.get(r)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGUSR1)
                    dumped.append(r)
                except OSError:
                    pass
        text = self._report_text(d, silent, dumped)
        if d.fatal:
            text += (
                f"\nStopping the job: HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="
                f"{self.stall_shutdown:g} was exceeded."
            )
            logger.error(text)
            # Only ranks that did not even answer the stack request are unresponsive: the
            # others are alive (e.g. waiting in a different collective, a deadlock).
            self.e.unresponsive = silent
            try:
                self.e.on_fatal_report(text)
            finally:
                self.e._abort(text)
        else:
            logger.warning(text)

    def _sites(self, p: Pending, stacks: dict[int, list]) -> str:
        """`` (at train.py:12 in step)``: where the submitting ranks called the collective."""
        sites: dict[str, list[int]] = {}
        for r, q in sorted(p.reqs.items()):
            site = q.site or (where(main_stack(stacks[r])) if r in stacks else "")
            if site:
                sites.setdefault(site, []).append(r)
        if not sites:
            return ""
        if len(sites) == 1:
            return f" at {next(iter(sites))}"
        return " at " + ", ".join(f"{s} ({ranks_text(rs)})" for s, rs in sites.items())

    def _waiting_in(self, rank: int) -> list[Stalled]:
        """Collectives ``rank`` submitted that still wait for other ranks."""
        return [st for st in self._unfinished(self.e.clock()) if rank in st.p.reqs]

    def _report_text(self, d: Diagnosis, silent: list[int], dumped: list[int]) -> str:
        n = len(d.stalled)
        lines = [
            f"Stall: {n} collective{'s' if n != 1 else ''} waited more than "
            f"{self.stall_check:g} s (HOROVOD_STALL_CHECK_TIME_SECONDS) for ranks that have "
            "not submitted them."
        ]
        deadlocks: dict[frozenset[str], tuple[Stalled, Stalled]] = {}
        shown: set[int] = set()
        for st in d.stalled:
            subs = sorted(st.p.reqs)
            lines.append(
                f"  {st.what}: submitted by {ranks_text(subs)}{self._sites(st.p, d.stacks)}, "
                f"waiting {st.waited:.1f} s for {ranks_text(st.missing)}."
            )
            for m in st.missing:
                elsewhere = self._waiting_in(m)
                if elsewhere:
                    other = elsewhere[0]
                    lines.append(
                        f"    rank {m} has not submitted it: it is waiting in {other.what}"
                        f"{self._sites(other.p, d.stacks)} for {ranks_text(other.missing)}."
                    )
                    if set(other.missing) & set(subs):
                        deadlocks.setdefault(frozenset((st.name, other.name)), (st, other))
                    continue
                if m in d.stacks and d.stacks[m]:
                    stack = d.stacks[m]
                    lines.append(
                        f"    rank {m} never submitted {st.what}; it is in "
                        f"{where(main_stack(stack))}"
                        + (":" if m not in shown else " (stack above).")
                    )
                    if m not in shown:
                        lines.append(format_stacks(stack))
                        shown.add(m)
                elif m in silent:
                    how = (
                        f"; its stacks were dumped to its stderr by faulthandler (lines "
                        f"prefixed [{m}]<stderr>)"
                        if m in dumped
                        else ""
                    )
                    lines.append(
                        f"    rank {m} never submitted {st.what}, and did not answer within "
                        f"{STACK_WAIT_SECONDS:g} s when asked where it is: its interpreter is "
                        "busy (most likely in C code that holds the GIL) or the process is "
                        f"stopped{how}."
                    )
                else:
                    lines.append(f"    rank {m} never submitted {st.what}.")
        for pair in deadlocks.values():
            # the collective with fewer callers first: the likelier one to be called by a subset
            a, b = sorted(pair, key=lambda st: (len(st.p.reqs), st.p.t0))
            sa, sb = sorted(a.p.reqs), sorted(b.p.reqs)
            if len(sa) != len(sb):
                few = a if len(sa) < len(sb) else b
                culprit = (
                    f"Most likely {few.what} is called by only {ranks_text(sorted(few.p.reqs))} "
                    "(for example inside `if hvd.rank() == 0:`)"
                )
            else:
                culprit = (
                    "One of them is called by only some ranks (for example inside "
                    "`if hvd.rank() == 0:`)"
                )
            lines.append(
                f"Deadlock: {ranks_text(sa)} wait{'s' if len(sa) == 1 else ''} in {a.what}"
                f"{self._sites(a.p, d.stacks)} for {ranks_text(a.missing)}, while {ranks_text(sb)} "
                f"wait{'s' if len(sb) == 1 else ''} in {b.what}{self._sites(b.p, d.stacks)} "
                f"for {ranks_text(b.missing)}: neither can ever complete. {culprit}, or the ranks "
                "call collectives in different orders. Every rank of the process set must call "
                "every collective, in the same order (or with matching names)."
            )
        return "\n".join(lines)
