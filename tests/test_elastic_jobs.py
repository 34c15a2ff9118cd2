"""Elastic jobs for real: ``horovodrun --min-np/--host-discovery-script`` running
``horovod.testing.elastic_train`` with injected faults (an exception, ``os._exit``, SIGKILL,
SIGSTOP at chosen (epoch, batch) points) and a discovery script whose output changes while the
job trains. One machine plays several hosts: ``localhost`` and ``127.0.0.1`` both start locally.

Every job is checked end to end: its exit status and message, the final weights (bitwise equal
on every rank, and equal to full-batch training without faults up to rounding, so no batch was
skipped or applied twice), the batches redone after each failure, and that no worker is left.
Upstream Horovod bugs that the design avoids are named in the tests' names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest

from horovod.testing.elastic_train import reference_weights
from tests.conftest import REPO

TWO_HOSTS = "localhost:2,127.0.0.1:2"


@dataclass
class Job:
    rc: int
    out: str
    err: str
    log: list[tuple[int, int, int, int]]  # (epoch, batch, size, round) per finished batch
    weights: list[np.ndarray]
    counters: list[dict]
    seconds: float


def run_job(
    tmp_path: Path,
    launcher: list[str],
    *,
    faults: list[dict] | None = None,
    epochs: int = 2,
    batches: int = 8,
    train: list[str] | None = None,
    hosts_file: Path | None = None,
    when: list[tuple[object, str]] | None = None,
    command: list[str] | None = None,
    timeout: float = 90,
) -> Job:
    """Run an elastic job; ``when``: (condition, new hosts-file text) pairs applied in order,
    a condition being a number of finished batches (int), the name of a fault that fired, or
    seconds since the previous change (float). The hosts file is replaced in one step, so the
    discovery script never reads it half written."""
    log, out = tmp_path / "log", tmp_path / "out"
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        HVD_TEST_FAULTS=json.dumps(faults or []),
        HVD_TEST_FAULT_DIR=str(tmp_path),
        HVD_TEST_MARK=str(tmp_path),
        HOROVOD_ELASTIC_DISCOVERY_SECONDS="0.2",
        HOROVOD_ELASTIC_POLL_SECONDS="0.1",
    )
    argv = [sys.executable, "-m", "horovod.runner.launch", *launcher]
    argv += command or [
        sys.executable,
        "-m",
        "horovod.testing.elastic_train",
        f"--epochs={epochs}",
        f"--batches={batches}",
        f"--log={log}",
        f"--out={out}",
        *(train or []),
    ]
    start = time.monotonic()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pending = list(when or [])
    changed = start
    try:
        while pending and p.poll() is None:
            cond, text = pending[0]
            done = len(log.read_text().splitlines()) if log.exists() else 0
            if (
                (isinstance(cond, int) and done >= cond)
                or (isinstance(cond, str) and (tmp_path / f"fault.{cond}").exists())
                or (isinstance(cond, float) and time.monotonic() - changed >= cond)
            ):
                assert hosts_file is not None
                new = hosts_file.with_suffix(".new")
                new.write_text(text)
                os.replace(new, hosts_file)
                changed = time.monotonic()
                pending.pop(0)
            time.sleep(0.02)
        stdout, stderr = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    seconds = time.monotonic() - start
    assert not pending, f"the job ended before these host changes: {pending}\n{stderr}"
    left = [
        q.pid
        for q in psutil.process_iter(["environ"])
        if (q.info.get("environ") or {}).get("HVD_TEST_MARK") == str(tmp_path)
    ]
    for pid in left:
        psutil.Process(pid).kill()
    assert not left, f"workers left running: {left}"
    lines = (
        [tuple(int(v) for v in ln.split()[1:]) for ln in log.read_text().splitlines()]
        if log.exists()
        else []
    )
    ranks = sorted(out.glob("rank.*.npy")) if out.exists() else []
    return Job(
        p.returncode,
        stdout,
        stderr,
        lines,  # type: ignore[arg-type]
        [np.load(f) for f in ranks],
        [json.loads(f.with_suffix(".json").read_text()) for f in ranks],
        seconds,
    )


def discovery(tmp_path: Path, text: str) -> tuple[Path, list[str]]:
    hosts = tmp_path / "hosts"
    hosts.write_text(text)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    return hosts, ["--host-discovery-script", str(script)]


def assert_trained_once(job: Job, epochs: int, batches: int, redo_at_most: int) -> None:
    """Completed, identical weights everywhere, every batch applied exactly once, and at most
    ``redo_at_most`` batches run twice (work rolled back to the last commit)."""
    assert job.rc == 0, job.err[-3000:]
    assert job.weights, job.err[-3000:]
    for w in job.weights[1:]:
        assert np.array_equal(w, job.weights[0])
    np.testing.assert_allclose(job.weights[0], reference_weights(epochs, batches), rtol=1e-9)
    assert {(c["epoch"], c["batch"]) for c in job.counters} == {(epochs, 0)}
    steps = [(e, b) for e, b, _, _ in job.log]
    assert set(steps) == {(e, b) for e in range(epochs) for b in range(batches)}
    assert len(steps) - len(set(steps)) <= redo_at_most


def sizes(job: Job) -> list[int]:
    """The job's size over time (one entry per change)."""
    out: list[int] = []
    for _, _, size, _ in job.log:
        if not out or out[-1] != size:
            out.append(size)
    return out


# ---------------------------------------------------------------------- failures
def test_one_rank_killed_on_two_hosts_of_two_slots_the_others_train_on(tmp_path):
    """Upstream #3264 (every worker died on one failure): the three survivors finish."""
    fault = {"id": "k", "epoch": 1, "batch": 2, "rank": 1, "how": "sigkill"}
    job = run_job(tmp_path, ["-np", "4", "--min-np", "2", "-H", TWO_HOSTS], faults=[fault])
    assert_trained_once(job, 2, 8, redo_at_most=1)
    assert sizes(job) == [4, 3]
    assert job.out.count("done: rank") == 3
    assert "1 worker failure(s) and 1 reset(s)" in job.err


def test_exception_and_os_exit_each_lose_one_worker_and_survivors_keep_their_seats(tmp_path):
    faults = [
        {"id": "r", "epoch": 0, "batch": 3, "rank": 1, "how": "raise"},
        {"id": "x", "epoch": 1, "batch": 5, "rank": 2, "how": "exit"},
    ]
    job = run_job(tmp_path, ["-np", "4", "--min-np", "2", "-H", TWO_HOSTS], faults=faults, epochs=2)
    assert_trained_once(job, 2, 8, redo_at_most=2)
    assert sizes(job) == [4, 3, 2]
    assert "injected fault r" in job.err
    assert "2 worker failure(s) and 2 reset(s)" in job.err


def test_commit_interval_bounds_the_work_redone(tmp_path):
    fault = {"id": "k", "epoch": 0, "batch": 6, "rank": 1, "how": "sigkill"}
    job = run_job(
        tmp_path,
        ["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1"],
        faults=[fault],
        train=["--commit-every=4"],
    )
    assert_trained_once(job, 2, 8, redo_at_most=2)  # batches 4 and 5 ran twice
    steps = [(e, b) for e, b, _, _ in job.log]
    assert steps[:9] == [(0, b) for b in range(6)] + [(0, 4), (0, 5), (0, 6)]


def test_a_frozen_worker_is_detected_and_stopped(tmp_path):
    fault = {"id": "f", "epoch": 0, "batch": 3, "rank": 2, "how": "sigstop"}
    job = run_job(
        tmp_path,
        [
            "-np", "3", "--min-np", "1", "-H", "localhost:2,127.0.0.1:1",
            "--stall-check-warning-time-seconds", "1", "--stall-check-shutdown-time-seconds", "3",
        ],
        faults=[fault],
    )  # fmt: skip
    assert_trained_once(job, 2, 8, redo_at_most=1)
    assert "made no progress" in job.err
    assert sizes(job) == [3, 2]


# ---------------------------------------------------------------------- hosts come and go
def test_hosts_added_then_removed_keep_the_epoch_and_batch(tmp_path):
    """Upstream #2844 (wrong epoch after a scale-up): counters continue where they were."""
    hosts, disc = discovery(tmp_path, "localhost:2\n")
    job = run_job(
        tmp_path,
        ["-np", "2", "--min-np", "1", "--max-np", "4", *disc],
        epochs=3,
        batches=16,
        train=["--step-seconds=0.05"],
        hosts_file=hosts,
        when=[(4, "localhost:2\n127.0.0.1:2\n"), (24, "127.0.0.1:2\n")],
    )
    assert_trained_once(job, 3, 16, redo_at_most=0)  # host changes happen at commits
    assert sizes(job) == [2, 4, 2]
    assert "localhost:0 has been removed from the elastic job" in job.err


def test_one_worker_drained_at_the_next_commit(tmp_path):
    """Upstream #4015 (no way to stop one chosen worker): list its host with one slot less."""
    hosts, disc = discovery(tmp_path, "localhost:2\n127.0.0.1:1\n")
    job = run_job(
        tmp_path,
        ["-np", "3", "--min-np", "1", *disc],
        batches=16,
        train=["--step-seconds=0.05"],
        hosts_file=hosts,
        when=[(3, "localhost:1\n127.0.0.1:1\n")],
    )
    assert_trained_once(job, 2, 16, redo_at_most=0)
    assert sizes(job) == [3, 2]
    assert "localhost:1 has been removed from the elastic job" in job.err


def test_a_deleted_pod_its_workers_killed_and_its_host_gone(tmp_path):
    """Upstream #3852 (a deleted Kubernetes pod failed the job)."""
    hosts, disc = discovery(tmp_path, "localhost:1\n127.0.0.1:2\n")
    faults = [
        {"id": "p1", "epoch": 0, "batch": 4, "rank": 1, "how": "sigkill"},
        {"id": "p2", "epoch": 0, "batch": 4, "rank": 2, "how": "sigkill"},
    ]
    job = run_job(
        tmp_path,
        ["-np", "3", "--min-np", "1", *disc],
        faults=faults,
        hosts_file=hosts,
        when=[("p1", "localhost:1\n")],
    )
    assert_trained_once(job, 2, 8, redo_at_most=1)
    assert sizes(job) == [3, 1]


def test_a_discovery_that_lists_no_hosts_for_a_moment_costs_one_reset(tmp_path):
    """A discovery script that printed nothing once (an empty file, a cloud API that timed out)
    used to end the job, since no worker holding the state was in the next round. The driver
    now waits for the survivors' hosts to be listed again, and they train on."""
    hosts, disc = discovery(tmp_path, "localhost:2\n")
    job = run_job(
        tmp_path,
        ["-np", "2", "--min-np", "1", "--elastic-timeout", "30", *disc],
        batches=24,
        train=["--step-seconds=0.05"],
        hosts_file=hosts,
        when=[(4, ""), (1.0, "localhost:2\n")],
    )
    assert_trained_once(job, 2, 24, redo_at_most=0)
    assert sizes(job) == [2]
    assert sorted({r for _, _, _, r in job.log}) == [0, 1]  # one reset, the same two workers
    assert "host discovery no longer lists localhost" in job.err
    assert "lists the workers' hosts again; round 1 goes on with them" in job.err


def test_survivors_hosts_never_listed_again_end_the_job_after_the_elastic_timeout(tmp_path):
    hosts, disc = discovery(tmp_path, "localhost:2\n")
    job = run_job(
        tmp_path,
        ["-np", "2", "--min-np", "1", "--elastic-timeout", "2", *disc],
        batches=40,
        train=["--step-seconds=0.05"],
        hosts_file=hosts,
        when=[(4, "127.0.0.1:2\n")],  # (another host: no survivor there)
    )
    assert job.rc == 1
    assert (
        "host discovery has not listed localhost for 2 s, and the training state lives only "
        "in the workers of round 0 there (2 alive)" in job.err
    )
    assert job.seconds < 30


def test_a_blacklisted_host_comes_back_after_its_cooldown(tmp_path):
    fault = {"id": "k", "epoch": 0, "batch": 2, "rank": 1, "how": "sigkill"}
    job = run_job(
        tmp_path,
        [
            "-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1",
            "--blacklist-cooldown-range", "1", "1",
        ],
        faults=[fault],
        epochs=2,
        batches=40,
        train=["--step-seconds=0.05"],
    )  # fmt: skip
    assert_trained_once(job, 2, 40, redo_at_most=1)
    assert sizes(job) == [2, 1, 2]


# ---------------------------------------------------------------------- the job ends
def test_every_rank_failing_ends_the_job_with_a_clear_message(tmp_path):
    faults = [{"id": f"a{r}", "epoch": 0, "batch": 2, "rank": r, "how": "exit"} for r in range(3)]
    job = run_job(
        tmp_path, ["-np", "3", "--min-np", "1", "-H", "localhost:2,127.0.0.1:1"], faults=faults
    )
    assert job.rc == 1
    assert "no worker of round 0 is left to hand over the training state" in job.err
    assert job.err.count("exited with code 1") >= 3


def test_every_host_blacklisted(tmp_path):
    job = run_job(
        tmp_path,
        ["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1"],
        command=[sys.executable, "-c", "import sys; print('broken'); sys.exit(3)"],
    )
    assert job.rc == 1
    assert "every host is blacklisted after failures" in job.err
    assert "exited with code 3" in job.err and "broken" in job.err


def test_fewer_than_min_np_survivors_time_out_instead_of_deadlocking(tmp_path):
    """Upstream #3494 (survivors deadlocked below --min-np)."""
    fault = {"id": "k", "epoch": 0, "batch": 2, "rank": 1, "how": "sigkill"}
    job = run_job(
        tmp_path,
        ["-np", "2", "--min-np", "2", "-H", "localhost:1,127.0.0.1:1", "--elastic-timeout", "2"],
        faults=[fault],
    )
    assert job.rc == 1
    assert (
        "Timed out after 2 s waiting for the minimum number of slots: 1 usable, 2 needed" in job.err
    )
    assert job.seconds < 30


def test_min_np_never_available_at_start(tmp_path):
    job = run_job(
        tmp_path, ["-np", "3", "--min-np", "3", "-H", "localhost:2", "--elastic-timeout", "1"]
    )
    assert job.rc == 1
    assert "2 usable, 3 needed" in job.err


def test_reset_limit(tmp_path):
    faults = [
        {"id": "a", "epoch": 0, "batch": 2, "rank": 1, "how": "raise"},
        {"id": "b", "epoch": 0, "batch": 5, "rank": 1, "how": "raise"},
    ]
    job = run_job(
        tmp_path,
        ["-np", "3", "--min-np", "1", "-H", "localhost:1,127.0.0.1:2", "--reset-limit", "1"],
        faults=faults,
    )
    assert job.rc == 1
    assert "the job was reset 2 times, more than --reset-limit 1 allows" in job.err


@pytest.mark.parametrize(
    "args, message",
    [
        (["-np", "2", "--min-np", "3"], "--min-np <= -np <= --max-np"),
        (["-np", "2", "--max-np", "1", "--min-np", "1"], "--min-np <= -np <= --max-np"),
        (["-np", "2", "--reset-limit", "1"], "are for elastic jobs"),
        (
            ["--min-np", "1", "--blacklist-cooldown-range", "0", "5"],
            "1 <= MIN <= MAX <= 3600",
        ),
        (["--min-np", "1", "--host-discovery-script", "x", "-H", "a:1"], "not both"),
    ],
)
def test_bad_elastic_arguments(args, message, capsys):
    from horovod.runner.launch import main

    assert main([*args, "python", "x.py"]) == 2
    assert message in capsys.readouterr().err


def test_discovery_script_failing_at_start(tmp_path, capsys):
    from horovod.runner.launch import main

    assert main(["--min-np", "1", "--host-discovery-script", "exit 7", "python", "x.py"]) == 2
    assert "failed: exit code 7" in capsys.readouterr().err


def test_the_elastic_campaign_short_run():
    """``python -m horovod.benchmarks.elastic`` (its figures are in docs/elastic.md)."""
    from horovod.benchmarks.elastic import main

    assert main(["--changes", "5", "--seed", "3", "--epochs", "6", "--batches", "40"]) == 0
