"""The benchmarks survive a peer that crashes or hangs: the run is recorded as failed for its
pass (exit status, last line) and the other configurations are still measured."""

from __future__ import annotations

import os
import sys
import time

import psutil
import pytest

from horovod.benchmarks import launch, tf_training, training


def test_a_crashing_run_gives_its_status_and_last_lines():
    cmd = [
        sys.executable,
        "-c",
        "import sys; print('boom at step 3', file=sys.stderr); sys.exit(7)",
    ]
    status, tail = launch.run_process(cmd, dict(os.environ), timeout=60)
    assert status == 7 and "boom at step 3" in tail


def test_a_hanging_run_is_killed_with_its_whole_process_group(tmp_path):
    """A launcher that hangs (its worker too) is killed after the timeout, workers included."""
    pid_file = tmp_path / "child"
    code = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
        "print('waiting for the peer', file=sys.stderr, flush=True)\n"
        "time.sleep(600)\n"
    )
    t0 = time.monotonic()
    status, tail = launch.run_process([sys.executable, "-c", code], dict(os.environ), timeout=3)
    assert status is None and "waiting for the peer" in tail
    assert time.monotonic() - t0 < 30
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the hung launcher's worker outlived it"
        time.sleep(0.05)


def test_launch_failed_names_what_failed():
    e = launch.LaunchFailed(
        "torchrun with 2 ranks", -6, "noise\nterminate called without an active exception\n\n"
    )
    assert "torchrun with 2 ranks exited with -6" in str(e)
    assert e.summary() == "exit status -6: terminate called without an active exception"
    hung = launch.LaunchFailed("mpirun with 2 ranks", None, "", hung=True)
    assert "hung" in str(hung) and hung.summary().startswith("hung")


def fake_run(failing: set[tuple[str, int]], calls: list):
    figures = {"plain": 100.0, "lockstep": 180.0, "horovod": 50.0, "ddp": 40.0}

    def run(kind, np_, model, steps, warmup, batch, extra_env=None):
        calls.append((kind, np_))
        if (kind, np_) in failing:
            raise launch.LaunchFailed(
                f"{kind} with {np_} ranks", -6, "terminate called without an active exception"
            )
        return figures[kind] * np_

    return run


def table_row(out: str, model: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith(f"| {model} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_training_benchmark_goes_on_when_the_ddp_peer_aborts(monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(training, "run", fake_run({("ddp", 2)}, calls))
    rc = training.main(["--models", "convnet", "--repeats", "2"])
    out = capsys.readouterr().out
    assert rc == 0  # a peer failing is recorded, not ours
    assert len(calls) == 14  # every configuration, both passes
    cells = table_row(out, "convnet")
    assert cells[5] == "100" and cells[6] == "40" and cells[7] == "failed"  # horovod 2, DDP 1, 2
    assert cells[10] == "100% / 50%" and cells[11] == "failed / failed" and cells[12] == "failed"
    assert "Runs that failed" in out
    assert out.count("- convnet, ddp at 2 rank(s): exit status -6: terminate called") == 2


def test_training_benchmark_keeps_the_passes_that_worked(monkeypatch, capsys):
    """A failure in one pass only: the best figure of the other pass stands."""
    calls: list = []
    run = fake_run(set(), calls)
    failed_once = []

    def flaky(kind, np_, *args, **kw):
        if (kind, np_) == ("ddp", 2) and not failed_once:
            failed_once.append(1)
            raise launch.LaunchFailed("torchrun with 2 ranks", 1, "RuntimeError: Connection reset")
        return run(kind, np_, *args, **kw)

    monkeypatch.setattr(training, "run", flaky)
    assert training.main(["--models", "convnet", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert table_row(out, "convnet")[7] == "80" and table_row(out, "convnet")[12] == "1.25x"
    assert out.count("- convnet, ddp at 2 rank(s)") == 1


def test_training_benchmark_fails_when_horovod_itself_fails(monkeypatch, capsys):
    monkeypatch.setattr(training, "run", fake_run({("horovod", 2)}, []))
    assert training.main(["--models", "convnet", "--repeats", "1"]) == 1
    assert "- convnet, horovod at 2 rank(s)" in capsys.readouterr().out


@pytest.mark.parametrize("failing,rc", [(("mwms", 2), 0), (("horovod", 2), 1)])
def test_tf_training_benchmark_goes_on_past_a_failure(monkeypatch, capsys, failing, rc):
    def run(kind, np_, *args):
        if (kind, np_) == failing:
            raise launch.LaunchFailed(kind, 1, "worker lost")
        return {"plain": 100.0, "horovod": 90.0, "mwms": 60.0}[kind] * np_

    monkeypatch.setattr(tf_training, "run", run)
    assert tf_training.main(["--models", "mlp50", "--repeats", "1"]) == rc
    out = capsys.readouterr().out
    cells = table_row(out, "mlp50")
    assert (
        cells.count("failed") == 3
        and f"- mlp50, {failing[0]} at 2 rank(s): exit status 1: worker lost" in out
    )
