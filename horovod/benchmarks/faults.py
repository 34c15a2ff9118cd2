"""Reliability campaigns: randomized fault trials against real ``horovodrun`` jobs.

    python -m horovod.benchmarks.faults                       # 10 trials of each kind
    python -m horovod.benchmarks.faults --trials 40 --seed 7
    python -m horovod.benchmarks.faults --kinds kill,fuzz --trials 5

Kinds of trial (each one a fresh job of 2 or 3 ranks, drawn at random with the fault):

* ``kill``: a random rank dies at a random step of a loop of collectives (SIGKILL,
  ``os._exit``, an exception). The job must end, horovodrun must name that rank as the root
  cause, and no process of the job may be left.
* ``mismatch``: one rank submits a collective that disagrees with the others' in one field
  (collective, dtype, shape, number of dimensions, trailing dimensions, reduce op, scale
  factors, root rank; every field in turn). Every rank must get an error naming the field,
  and the job must go on (a barrier after it) and end cleanly.
* ``name``: one rank submits a collective under another name: nobody can match it. The stall
  inspector must stop the job at HOROVOD_STALL_SHUTDOWN_TIME_SECONDS with its report.
* ``fuzz``: while a job runs a loop of checked allreduces, connections that never proved the
  job's secret send random bytes to every port the job listens on. The job must finish with
  correct results.
* ``lost-host`` (root with iproute2 and sshd only): a 2-host job on network-namespace hosts
  over TCP; one host's link goes down at a random moment. The job must end naming the host,
  and no process may be left on either host.

Printed per kind: trials, passed, hangs (no end within ``--timeout``), time from the fault to
the end of the job (median and max), and trials where some rank missed its error; then each
failed trial with its parameters and what went wrong. Exit status 1 if any trial failed.

Must not touch: the runtime's internals (it runs jobs with ``horovodrun`` like a user).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from horovod.testing.netns import TestNetwork, processes_with, unavailable

REPO = Path(__file__).resolve().parents[2]  # the checkout whose horovod the jobs import
KINDS = ("kill", "mismatch", "name", "fuzz", "lost-host")
FIELDS = {  # mismatched field -> what every rank's error must say
    "collective": "must call the same collective",
    "dtype": "dtype",
    "shape": "shape",
    "ndim": "number of dimensions",
    "trailing": "only the first dimension may differ",
    "op": "reduce op",
    "scale": "prescale_factor",
    "root": "root_rank",
}

WORKER = """
    import json, os, signal, sys, time
    import numpy as np
    import horovod.numpy as hvd

    spec = json.loads(sys.argv[1])
    hvd.init()
    r, n = hvd.rank(), hvd.size()

    def fault():
        print("FAULT", repr(time.time()), flush=True)

    kind = spec["kind"]
    if kind in ("kill", "lost-host"):
        print("RUNNING", flush=True)
        for step in range(spec["steps"]):
            if kind == "kill" and r == spec["rank"] and step == spec["at"]:
                fault()
                if spec["how"] == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif spec["how"] == "exit":
                    os._exit(3)
                raise RuntimeError("injected failure")
            which = step % 3
            if which == 0:
                hvd.allreduce(np.ones(spec["elems"], np.float32), name="loop.r")
            elif which == 1:
                hvd.allgather(np.ones((r + 1, 4), np.float32), name="loop.g")
            else:
                hvd.broadcast(np.ones(64), root_rank=step % n, name="loop.b")
            if kind == "lost-host":
                time.sleep(0.01)
    elif kind == "mismatch":
        for _ in range(3):
            hvd.allreduce(np.ones(4), name="warm")
        bad = r == spec["rank"]
        f = spec["field"]
        x = np.ones(4, np.float32)
        fault()
        try:
            if f == "collective":
                (hvd.allgather if bad else hvd.allreduce)(x, name="m")
            elif f == "dtype":
                hvd.allreduce(x.astype(np.float64) if bad else x, name="m")
            elif f == "shape":
                hvd.allreduce(np.ones(5 if bad else 4, np.float32), name="m")
            elif f == "ndim":
                hvd.allgather(np.ones((2, 2, 1) if bad else (2, 2)), name="m")
            elif f == "trailing":
                hvd.allgather(np.ones((2, 3 if bad else 2)), name="m")
            elif f == "op":
                hvd.allreduce(x, op=hvd.Max if bad else hvd.Sum, name="m")
            elif f == "scale":
                hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0 if bad else 1.0, name="m")
            elif f == "root":
                hvd.broadcast(x, root_rank=1 if bad else 0, name="m")
            print("NOERROR", flush=True)
        except Exception as e:
            print("ERROR", type(e).__name__, str(e).splitlines()[0], flush=True)
        hvd.barrier()
        print("DONE", flush=True)
    elif kind == "name":
        hvd.allreduce(np.ones(4), name="warm")
        fault()
        hvd.allreduce(np.ones(4), name="renamed" if r == spec["rank"] else "m")
    elif kind == "fuzz":
        print("READY", flush=True)
        for step in range(spec["steps"]):
            out = hvd.allreduce(np.full(1000, r + step, np.float32), op=hvd.Sum, name="f")
            assert (out == n * (n - 1) / 2 + n * step).all(), (step, out[:4])
            time.sleep(0.01)
        print("CORRECT", flush=True)
    hvd.shutdown()
"""


@dataclass
class Trial:
    kind: str
    params: dict[str, Any]
    passed: bool = False
    hung: bool = False
    missing_error: bool = False
    to_exit: float | None = None  # seconds from the fault to the end of the job
    why: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


class Job:
    """One horovodrun job of the worker script, its output collected as it runs."""

    def __init__(
        self,
        script: Path,
        np_: int,
        spec: dict,
        env: dict,
        argv_prefix: Any = (),
        launcher_args: Any = (),
    ) -> None:
        self.marker = uuid.uuid4().hex
        full = dict(os.environ, **env)
        full["HVD_FAULTS_JOB"] = self.marker
        full["PYTHONPATH"] = str(REPO) + os.pathsep + full.get("PYTHONPATH", "")
        cmd = [
            *argv_prefix,
            sys.executable,
            "-m",
            "horovod.runner.launch",
            *launcher_args,
            "-np",
            str(np_),
            sys.executable,
            str(script),
            json.dumps(spec),
        ]
        self.proc = subprocess.Popen(
            cmd,
            env=full,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self.readers:
            t.start()

    @staticmethod
    def _read(stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def wait_for(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if any(text in line for line in self.out):
                return True
            time.sleep(0.02)
        return any(text in line for line in self.out)

    def finish(self, timeout: float) -> tuple[bool, float]:
        """Wait for the end; (hung, when it ended). A hung job's processes are all killed."""
        try:
            self.proc.wait(timeout)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        ended = time.time()
        for t in self.readers:
            t.join(5)
        return hung, ended

    def fault_time(self) -> float | None:
        times = [float(m.group(1)) for x in self.out if (m := re.search(r"FAULT (\S+)", x))]
        return min(times) if times else None

    def leftovers(self, within: float = 10.0) -> list[int]:
        """Processes of this job still alive after ``within`` seconds (then killed)."""
        deadline = time.monotonic() + within
        left = processes_with(f"HVD_FAULTS_JOB={self.marker}")
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = processes_with(f"HVD_FAULTS_JOB={self.marker}")
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)


def _listening_ports(root_pid: int) -> list[int]:
    """TCP ports the job's processes (horovodrun and its workers) listen on."""
    ports: set[int] = set()
    try:
        procs = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for p in procs:
        try:
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    ports.add(c.laddr.port)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sorted(ports)


def _fuzz(ports: list[int], rng: random.Random, per_port: int) -> int:
    """Connect to every port ``per_port`` times and send random bytes; connections made."""
    made = 0
    for port in ports:
        for _ in range(per_port):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    s.settimeout(0.5)
                    s.sendall(rng.randbytes(rng.randint(1, 4096)))
                    made += 1
                    try:
                        s.recv(64)  # the peer may answer or close: either is fine
                    except OSError:
                        pass
            except OSError:
                pass
    return made


class Campaign:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.rng = random.Random(args.seed)
        self.dir = Path(tempfile.mkdtemp(prefix="hvd-faults-"))
        self.script = self.dir / "worker.py"
        self.script.write_text(textwrap.dedent(WORKER))
        self.net: TestNetwork | None = None
        self.fields = list(FIELDS)
        self.rng.shuffle(self.fields)
        self.mismatches = 0

    def close(self) -> None:
        if self.net is not None:
            self.net.close()
        for p in self.dir.iterdir():
            p.unlink()
        self.dir.rmdir()

    def job(self, np_: int, spec: dict, env: dict | None = None) -> Job:
        env = {"OMP_NUM_THREADS": "1", **(env or {})}
        return Job(self.script, np_, spec, env)

    # ---------------------------------------------------------------------------- kinds
    def kill(self) -> Trial:
        np_ = self.rng.choice([2, 3])
        p = {
            "np": np_,
            "rank": self.rng.randrange(np_),
            "at": self.rng.randrange(1, 60),
            "how": self.rng.choice(["sigkill", "exit", "exception"]),
            "elems": self.rng.choice([16, 5000, 100_000]),
        }
        t = Trial("kill", p)
        job = self.job(np_, {"kind": "kill", "steps": 10_000, **p})
        hung, ended = job.finish(self.a.timeout)
        fault = job.fault_time()
        t.hung, t.to_exit = hung, (ended - fault) if fault else None
        left = job.leftovers()
        named = f"Root cause: rank {p['rank']} " in job.stderr
        if hung:
            t.why = "no end"
        elif job.proc.returncode == 0:
            t.why = "exit status 0"
        elif not named:
            t.why = f"root cause not rank {p['rank']}: {_root_cause(job.stderr)}"
        elif left:
            t.why = f"processes left: {left}"
        else:
            t.passed = True
        return t

    def mismatch(self) -> Trial:
        np_ = self.rng.choice([2, 3])
        # every field in turn (in an order drawn once), so a run of len(FIELDS) trials
        # covers them all
        self.mismatches += 1
        p: dict[str, Any] = {
            "np": np_,
            "rank": self.rng.randrange(np_),
            "field": self.fields[(self.mismatches - 1) % len(self.fields)],
        }
        if p["field"] == "root" and p["rank"] != 0 and np_ == 2:
            p["rank"] = 0  # (rank 0 passing root 1 against root 0 elsewhere: still a mismatch)
        t = Trial("mismatch", p)
        # (a stall check of 5 s: collectives of different kinds under one name, which never
        # meet, are refused after half a second)
        env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "5"}
        job = self.job(np_, {"kind": "mismatch", **p}, env)
        hung, ended = job.finish(self.a.timeout)
        fault = job.fault_time()
        t.hung, t.to_exit = hung, (ended - fault) if fault else None
        want = FIELDS[p["field"]]
        errors = {
            int(m.group(1)): m.group(2)
            for m in re.finditer(r"\[(\d+)\]<stdout>:ERROR (.*)", job.stdout)
        }
        missing = [r for r in range(np_) if want not in errors.get(r, "")]
        t.missing_error = bool(missing)
        if hung:
            t.why = "no end"
        elif missing:
            t.why = f"ranks {missing} without an error naming {want!r}: {errors}"
        elif job.proc.returncode != 0 or job.stdout.count("<stdout>:DONE") != np_:
            t.why = f"the job did not go on after the error (exit {job.proc.returncode})"
        else:
            t.passed = True
        return t

    def name(self) -> Trial:
        np_ = self.rng.choice([2, 3])
        p = {"np": np_, "rank": self.rng.randrange(np_)}
        t = Trial("name", p)
        env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3"}
        job = self.job(np_, {"kind": "name", **p}, env)
        hung, ended = job.finish(self.a.timeout)
        fault = job.fault_time()
        t.hung, t.to_exit = hung, (ended - fault) if fault else None
        left = job.leftovers()
        if hung:
            t.why = "no end"
        elif "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=3 was exceeded" not in job.stderr:
            t.why = "no stall report: " + job.stderr[-500:]
        elif "'renamed'" not in job.stderr or "'m'" not in job.stderr:
            t.why = "the report does not name both collectives"
        elif left:
            t.why = f"processes left: {left}"
        else:
            t.passed = True
        return t

    def fuzz(self) -> Trial:
        np_ = self.rng.choice([2, 3])
        p = {"np": np_, "per_port": self.rng.randint(1, 4), "steps": 150}
        t = Trial("fuzz", p)
        job = self.job(np_, {"kind": "fuzz", "steps": p["steps"]})
        if not job.wait_for("READY", 60):
            job.finish(1)
            t.why = "the job did not start: " + job.stderr[-300:]
            return t
        ports = _listening_ports(job.proc.pid)
        fault = time.time()
        t.detail["ports"] = len(ports)
        t.detail["connections"] = _fuzz(ports, self.rng, p["per_port"])
        hung, ended = job.finish(self.a.timeout)
        t.hung, t.to_exit = hung, ended - fault
        if hung:
            t.why = "no end"
        elif job.proc.returncode != 0 or job.stdout.count("<stdout>:CORRECT") != np_:
            t.why = f"the job was disrupted (exit {job.proc.returncode}): {job.stderr[-500:]}"
        elif not ports:
            t.why = "no listening port found to fuzz"
        else:
            t.passed = True
        return t

    def lost_host(self) -> Trial:
        if self.net is None:
            self.net = TestNetwork(["hostA", "hostB"])
        net = self.net
        p = {"np": 4, "after": round(self.rng.uniform(0.2, 2.0), 2)}
        t = Trial("lost-host", p)
        spec = {"kind": "lost-host", "steps": 100_000, "elems": 1000, "rank": -1}
        env = {"OMP_NUM_THREADS": "1", "HOROVOD_SSH_KEEPALIVE_SECONDS": "1"}
        prefix = net.command("hostA", [])
        hosts = [*net.launcher_args(), "-H", "hostA:2,hostB:2"]
        job = Job(self.script, 4, spec, env, argv_prefix=prefix, launcher_args=hosts)
        try:
            if not job.wait_for("RUNNING", 60):
                job.finish(1)
                t.why = "the job did not start: " + job.stderr[-300:]
                return t
            time.sleep(p["after"])
            fault = time.time()
            net.link("hostB", up=False)
            hung, ended = job.finish(self.a.timeout)
        finally:
            net.link("hostB", up=True)
        t.hung, t.to_exit = hung, ended - fault
        left = job.leftovers(20)
        if hung:
            t.why = "no end"
        elif job.proc.returncode == 0:
            t.why = "exit status 0"
        elif "hostB" not in job.stderr:
            t.why = "hostB not named: " + job.stderr[-500:]
        elif left:
            t.why = f"processes left: {left}"
        else:
            t.passed = True
        return t


def _root_cause(stderr: str) -> str:
    m = re.search(r"Root cause.*", stderr)
    return m.group(0)[:200] if m else stderr[-300:]


def report(trials: list[Trial]) -> str:
    lines = [
        "| kind | trials | passed | hangs | time to exit, median (max) | errors missing on some rank |",
        "|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        ts = [t for t in trials if t.kind == kind]
        if not ts:
            continue
        times = [t.to_exit for t in ts if t.to_exit is not None and not t.hung]
        timing = f"{statistics.median(times):.2f} s ({max(times):.2f} s)" if times else "-"
        lines.append(
            f"| {kind} | {len(ts)} | {sum(t.passed for t in ts)} | {sum(t.hung for t in ts)} | "
            f"{timing} | {sum(t.missing_error for t in ts)} |"
        )
    failed = [t for t in trials if not t.passed]
    if failed:
        lines.append("\nFailed trials:")
        lines += [f"- {t.kind} {json.dumps(t.params)}: {t.why}" for t in failed]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10, help="per kind")
    ap.add_argument("--kinds", default="kill,mismatch,name,fuzz,lost-host")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds: longer is a hang")
    a = ap.parse_args(argv)
    kinds = [k for k in a.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        ap.error(f"unknown kinds {unknown}; choose from {', '.join(KINDS)}")
    if "lost-host" in kinds and (why := unavailable()):
        print(f"skipping lost-host: {why}")
        kinds.remove("lost-host")
    campaign = Campaign(a)
    trials: list[Trial] = []
    try:
        for kind in kinds:
            run = getattr(campaign, kind.replace("-", "_"))
            for i in range(a.trials):
                trial = run()
                trials.append(trial)
                status = "ok" if trial.passed else f"FAILED: {trial.why}"
                print(f"{kind} {i + 1}/{a.trials} {json.dumps(trial.params)}: {status}", flush=True)
    finally:
        campaign.close()
    print(f"\nseed {a.seed}, {a.trials} trial(s) per kind, hang = no end within {a.timeout:g} s\n")
    print(report(trials))
    return 0 if all(t.passed for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
