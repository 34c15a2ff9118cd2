"""The elastic campaign: many membership changes during one training run.

    python -m horovod.benchmarks.elastic                 # 20 changes (kills and host additions)
    python -m horovod.benchmarks.elastic --changes 4     # a short run (CI)

One ``horovodrun --host-discovery-script`` job trains ``horovod.testing.elastic_train`` (a
linear model, committed after every batch) on three host names of this machine
(``localhost``, ``127.0.0.1`` and its own name, two slots each; they start locally). While it
trains, the campaign makes one change at a time: SIGKILL a random worker, add a host that is
not listed yet, or remove a listed one (a graceful drain) (a killed worker's host is blacklisted with a 1-4 s cooldown, then comes back).
It kills only while at least three workers run, so a survivor always holds the state. After
each change it waits for training to resume in a new round before the next.

It prints, and with ``--json`` writes: the changes made; the time from each kill to the first
batch finished after it (median and max); the most batches run twice after one change (with a
commit every batch: at most 1); whether the job completed, whether the final weights are
bitwise identical on every rank, and whether they match full-batch training without faults.

Must not touch: processes other than the job it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from horovod.testing.elastic_train import reference_weights

HOSTS = ["localhost", "127.0.0.1", socket.gethostname()]


class Campaign:
    def __init__(self, workdir: Path, changes: int, seed: int, epochs: int, batches: int) -> None:
        self.dir = workdir
        self.changes, self.epochs, self.batches = changes, epochs, batches
        self.rng = random.Random(seed)
        self.log = workdir / "log"
        self.hosts_file = workdir / "hosts"
        self.listed = HOSTS[:2]
        self.kills: list[float] = []
        self.added: list[float] = []
        self.removed: list[float] = []
        self.events: list[tuple[float, str]] = []

    def write_hosts(self) -> None:
        """The discovery script's hosts, replaced in one step: a ``cat`` of a file being
        rewritten in place could read it empty, a discovery of no hosts at all, which ends
        the job (no worker left to hand the state over)."""
        part = self.hosts_file.with_suffix(".new")
        part.write_text("".join(f"{h}:2\n" for h in self.listed))
        os.replace(part, self.hosts_file)

    def lines(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [ln.split() for ln in self.log.read_text().splitlines() if ln.strip()]

    def workers(self) -> list[psutil.Process]:
        out = []
        for q in psutil.process_iter(["environ"]):
            env = q.info.get("environ") or {}
            if env.get("HVD_CAMPAIGN") == str(self.dir) and env.get("HOROVOD_ELASTIC_SLOT"):
                out.append(q)
        return out

    def round_at(self, t: float) -> int:
        """The membership round training was in at time ``t``."""
        before = [int(ln[4]) for ln in self.lines() if float(ln[0]) <= t]
        return before[-1] if before else 0

    def wait_progress(self, after: float, batches: int, timeout: float = 60.0) -> bool:
        """Wait until ``batches`` batches finished in a round newer than the one at ``after``."""
        deadline = time.monotonic() + timeout
        old = self.round_at(after)
        while time.monotonic() < deadline:
            newer = [ln for ln in self.lines() if float(ln[0]) > after and int(ln[4]) > old]
            if len(newer) >= batches:
                return True
            time.sleep(0.05)
        return False

    def run(self) -> dict:
        self.write_hosts()
        script = self.dir / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
        script.chmod(0o755)
        out = self.dir / "out"
        env = dict(os.environ)
        env.update(
            HVD_CAMPAIGN=str(self.dir),
            HOROVOD_ELASTIC_DISCOVERY_SECONDS="0.2",
            HOROVOD_ELASTIC_POLL_SECONDS="0.1",
        )
        argv = [
            sys.executable, "-m", "horovod.runner.launch", "-np", "4", "--min-np", "1",
            "--host-discovery-script", str(script), "--blacklist-cooldown-range", "1", "4",
            sys.executable, "-m", "horovod.testing.elastic_train",
            f"--epochs={self.epochs}", f"--batches={self.batches}", "--step-seconds=0.01",
            f"--log={self.log}", f"--out={out}",
        ]  # fmt: skip
        start = time.time()
        job = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            deadline = time.monotonic() + 60
            while len(self.lines()) < 5:
                if time.monotonic() > deadline or job.poll() is not None:
                    raise RuntimeError("the job did not start training")
                time.sleep(0.05)
            made = 0
            while made < self.changes and job.poll() is None:
                alive = self.workers()
                spare = [h for h in HOSTS if h not in self.listed]
                if len(alive) < 3 and not spare:
                    time.sleep(0.2)  # never kill the last workers: wait for a host to come back
                    continue
                made += 1
                choices = ["kill"] * 2 if len(alive) >= 3 else []
                choices += ["add"] if spare else []
                choices += ["remove"] if len(self.listed) > 1 and len(alive) >= 3 else []
                action = self.rng.choice(choices)
                if action == "add":
                    self.listed.append(self.rng.choice(spare))
                    self.write_hosts()
                    t = time.time()
                    self.added.append(t)
                    self.events.append((t - start, f"added host {self.listed[-1]}"))
                elif action == "remove":  # a graceful drain: its workers leave at a commit
                    gone = self.rng.choice(self.listed)
                    self.listed.remove(gone)
                    self.write_hosts()
                    t = time.time()
                    self.removed.append(t)
                    self.events.append((t - start, f"removed host {gone}"))
                else:
                    victim = self.rng.choice(alive)
                    slot = (victim.environ() or {}).get("HOROVOD_ELASTIC_SLOT", "?")
                    t = time.time()
                    victim.send_signal(signal.SIGKILL)
                    self.kills.append(t)
                    self.events.append((t - start, f"killed {slot}"))
                if not self.wait_progress(t, 3):
                    break  # the job ended (or stopped training): report what happened
                time.sleep(self.rng.uniform(0.0, 0.5))
            stdout, stderr = job.communicate(timeout=600)
        finally:
            if job.poll() is None:
                job.kill()
                job.communicate()
        return self.results(job.returncode, out, stderr)

    def results(self, rc: int, out: Path, stderr: str) -> dict:
        lines = self.lines()
        resume = []  # kill -> the first batch finished in a later round
        for k in self.kills:
            old = self.round_at(k)
            after = [float(ln[0]) for ln in lines if float(ln[0]) > k and int(ln[4]) > old]
            if after:
                resume.append(min(after) - k)
        steps = [(int(ln[1]), int(ln[2])) for ln in lines]
        redone_max = 0
        seen: set[tuple[int, int]] = set()
        run = 0
        for s in steps:
            if s in seen:
                run += 1
                redone_max = max(redone_max, run)
            else:
                run = 0
                seen.add(s)
        finals = [np.load(f) for f in sorted(out.glob("rank.*.npy"))] if out.exists() else []
        identical = bool(finals) and all(np.array_equal(w, finals[0]) for w in finals)
        matches = bool(finals) and bool(
            np.allclose(finals[0], reference_weights(self.epochs, self.batches), rtol=1e-9, atol=0)
        )
        counters = [json.loads(f.read_text()) for f in sorted(out.glob("rank.*.json"))]
        finished = bool(counters) and all(c["epoch"] == self.epochs for c in counters)
        return {
            "changes": len(self.kills) + len(self.added) + len(self.removed),
            "kills": len(self.kills),
            "hosts_added": len(self.added),
            "hosts_removed": len(self.removed),
            "exit_status": rc,
            "completed": rc == 0 and finished,
            "final_ranks": len(finals),
            "final_weights_identical": identical,
            "matches_fault_free_training": matches,
            "resume_after_kill_s": {
                "median": round(statistics.median(resume), 3) if resume else None,
                "max": round(max(resume), 3) if resume else None,
            },
            "most_batches_redone_after_one_change": redone_max,
            "events": [f"{t:6.1f} s  {what}" for t, what in self.events],
            "stderr_tail": stderr.splitlines()[-15:] if rc != 0 else [],
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--changes", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=0, help="default: enough for the changes")
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    epochs = a.epochs or max(4, a.changes * 2)
    with tempfile.TemporaryDirectory(prefix="hvd-elastic-campaign-") as d:
        r = Campaign(Path(d), a.changes, a.seed, epochs, a.batches).run()
    for e in r["events"]:
        print(e)
    for k, v in r.items():
        if k not in ("events", "stderr_tail"):
            print(f"{k}: {v}")
    for line in r["stderr_tail"]:
        print(f"  | {line}")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=2))
    ok = r["completed"] and r["final_weights_identical"] and r["matches_fault_free_training"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
