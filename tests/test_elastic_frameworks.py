"""Elastic training scripts of the frameworks, unchanged from upstream style, under a real
``horovodrun`` whose hosts change while they train: a host is added (the new worker receives
model, optimizer and sampler state from a survivor), then a worker is killed. The job must
finish with the expected accuracy and bitwise-identical parameters on every rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO


def _pid_of_slot(mark: str, slot: str) -> int | None:
    for q in psutil.process_iter(["environ"]):
        env = q.info.get("environ") or {}
        if env.get("HVD_TEST_MARK") == mark and env.get("HOROVOD_ELASTIC_SLOT") == slot:
            return q.pid
    return None


def run_changing_job(tmp_path: Path, script: list[str], events: list[tuple[str, str]]) -> tuple:
    """Run ``script`` elastically on discovered hosts (``localhost:2`` first). ``events``:
    (output line that triggers it, action): ``hosts:<text>`` rewrites the discovery output,
    ``kill:<slot>`` SIGKILLs that slot's worker."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    disc = tmp_path / "discover.sh"
    disc.write_text(f"#!/bin/sh\ncat {hosts}\n")
    disc.chmod(0o755)
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        HVD_TEST_MARK=str(tmp_path),
        HOROVOD_ELASTIC_DISCOVERY_SECONDS="0.2",
        HOROVOD_ELASTIC_POLL_SECONDS="0.1",
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    argv = [
        sys.executable, "-m", "horovod.runner.launch", "-np", "2", "--min-np", "1",
        "--host-discovery-script", str(disc), "--verbose", *script,
    ]  # fmt: skip
    p = subprocess.Popen(
        argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out: list[str] = []
    pending = list(events)
    assert p.stdout is not None
    try:
        for line in p.stdout:
            out.append(line)
            while pending and pending[0][0] in line:
                _, action = pending.pop(0)
                kind, _, arg = action.partition(":")
                if kind == "hosts":
                    hosts.write_text(arg)
                else:
                    deadline = time.monotonic() + 10
                    pid = None
                    while pid is None and time.monotonic() < deadline:
                        pid = _pid_of_slot(str(tmp_path), arg)
                    assert pid is not None, f"no worker for {arg}"
                    os.kill(pid, signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
    assert not pending, f"never happened: {pending}\n{''.join(out)}"
    return p.returncode, "".join(out)


def test_torch_elastic_example_grows_then_loses_a_worker(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    import torch

    save = tmp_path / "model"
    rc, out = run_changing_job(
        tmp_path,
        [
            sys.executable,
            str(REPO / "examples" / "elastic" / "pytorch_elastic_digits.py"),
            "--epochs=16",
            f"--save={save}",
        ],
        [
            ("round 0: 2 workers", "hosts:localhost:2\n127.0.0.1:1\n"),
            (": 3 workers\n", "kill:localhost:1"),  # the first epoch after the new one joined
        ],
    )
    assert rc == 0, out[-5000:]
    assert "round 1: 3 workers on localhost:2, 127.0.0.1:1" in out
    assert "epoch 15: 2 workers" in out
    assert "test accuracy" in out
    finals = [torch.load(f"{save}.rank{r}") for r in range(2)]
    for k in finals[0]:
        assert torch.equal(finals[0][k], finals[1][k]), k
    assert "rank 1 (localhost:1) was killed by signal SIGKILL" in out


def test_keras_elastic_example_grows_then_loses_a_worker(tmp_path):
    pytest.importorskip("tensorflow")
    pytest.importorskip("sklearn")
    import numpy as np

    save = tmp_path / "weights"
    rc, out = run_changing_job(
        tmp_path,
        [
            sys.executable,
            str(REPO / "examples" / "elastic" / "keras_elastic_digits.py"),
            "--epochs=40",
            f"--save={save}",
        ],
        [
            ("round 0: 2 workers", "hosts:localhost:2\n127.0.0.1:1\n"),
            (": 3 workers\n", "kill:localhost:1"),
        ],
    )
    assert rc == 0, out[-5000:]
    assert "round 1: 3 workers on localhost:2, 127.0.0.1:1" in out
    assert "epoch 39: 2 workers" in out
    assert "test accuracy" in out
    finals = [np.load(f"{save}.rank{r}.npz") for r in range(2)]
    assert len(finals[0].files) == 4
    for k in finals[0].files:
        assert np.array_equal(finals[0][k], finals[1][k]), k
    assert "rank 1 (localhost:1) was killed by signal SIGKILL" in out
