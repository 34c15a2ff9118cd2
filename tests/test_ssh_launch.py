"""The pieces of a multi-host launch as pure functions: the ssh command line, the payload the
remote supervisor reads (and what it refuses), environment carry-over, the choice of the
launcher's address, and which rank the failure report blames. The real thing over ssh between
network namespaces is tests/test_multihost.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from horovod.common.net import ipv4_addresses
from horovod.runner import ssh
from horovod.runner.procs import Command, Job, Worker, exit_description
from horovod.runner.remote import MAGIC, parse_payload


def test_ssh_command_line_options_port_identity_and_keepalive():
    argv = ssh.ssh_command("w1", "exec py", port=2222, identity="/k", keepalive_seconds=2)
    assert argv[0] == "ssh" and argv[-2:] == ["w1", "exec py"]
    joined = " ".join(argv)
    for opt in (
        "PasswordAuthentication=no",
        "StrictHostKeyChecking=no",
        "BatchMode=yes",
        "ServerAliveInterval=2",
        "ServerAliveCountMax=3",
    ):
        assert f"-o {opt}" in joined
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-i") + 1] == "/k"
    plain = ssh.ssh_command("w1", "true", keepalive_seconds=0)
    assert "-p" not in plain and "-i" not in plain and "ServerAliveInterval" not in " ".join(plain)


def test_supervisor_command_quotes_the_interpreter():
    assert ssh.supervisor_command("/opt/my env/bin/python") == (
        "exec '/opt/my env/bin/python' -m horovod.runner.remote"
    )


def test_exportable_environment_follows_upstreams_rule():
    env = {
        "PATH": "/bin",
        "HOROVOD_SECRET_KEY": "s",
        "CUDA_VISIBLE_DEVICES": "0",
        "BASH_FUNC_x%%": "() {}",
        "OLDPWD": "/",
        "MY_VAR": "1",
    }
    assert ssh.exportable(env) == {"PATH": "/bin", "MY_VAR": "1"}
    # workers on the launcher's host inherit the rest, except the launcher's own secret
    assert ssh.host_only(env) == {"CUDA_VISIBLE_DEVICES": "0", "OLDPWD": "/"}


def test_local_workers_see_the_gpus_the_launcher_sees():
    """``CUDA_VISIBLE_DEVICES=2,3 horovodrun -np 2 ...`` on one host: each rank sees those
    two GPUs (upstream's local workers inherit them), not every GPU of the machine."""
    from conftest import run_script

    r = run_script(
        "import os, horovod.torch as hvd\n"
        "hvd.init()\n"
        "print('SEES', hvd.rank(), os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True)\n",
        2,
        env={"CUDA_VISIBLE_DEVICES": "2,3"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SEES 0 2,3" in r.stdout and "SEES 1 2,3" in r.stdout


def test_payload_carries_env_and_cwd_but_not_host_local_names():
    line = ssh.payload(
        ["python", "t.py"],
        {
            "A": "1",
            "SSH_CLIENT": "x",
            "HOSTNAME": "me",
            "TMPDIR": "/tmp/x",
            "HOROVOD_SECRET_KEY": "ab",
        },
        "/w",
    )
    assert line.endswith(b"\n") and b"\n" not in line[:-1]
    d = parse_payload(line.decode())
    assert d["argv"] == ["python", "t.py"] and d["cwd"] == "/w"
    assert d["env"] == {"A": "1", "HOROVOD_SECRET_KEY": "ab"}


@pytest.mark.parametrize(
    "line, why",
    [
        ("not json", "not JSON"),
        (json.dumps({"magic": "other"}), "matching pyhorovod version"),
        (json.dumps({"magic": MAGIC, "argv": [], "env": {}}), "no command"),
        (json.dumps({"magic": MAGIC, "argv": ["x"], "env": None}), "no environment"),
    ],
)
def test_supervisor_refuses_a_bad_payload_with_a_reason(line, why):
    with pytest.raises(ValueError, match=why):
        parse_payload(line)


def _supervise(payload: bytes, close_after: float | None = None):
    p = subprocess.Popen(
        [sys.executable, "-m", "horovod.runner.remote"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert p.stdin is not None
    p.stdin.write(payload)
    p.stdin.flush()
    if close_after is not None:
        time.sleep(close_after)
        p.stdin.close()
    # Otherwise standard input stays open while the worker runs: its end means "stop".
    assert p.stdout is not None and p.stderr is not None
    out, err = p.stdout.read(), p.stderr.read()
    code = p.wait(30)
    if not p.stdin.closed:
        p.stdin.close()
    p.stdout.close()
    p.stderr.close()
    return code, out.decode(), err.decode()


def test_supervisor_runs_the_command_in_cwd_with_env_and_returns_its_status(tmp_path):
    code, out, _ = _supervise(
        ssh.payload(
            [
                sys.executable,
                "-c",
                "import os,sys; print(os.getcwd(), os.environ['X']); sys.exit(7)",
            ],
            {"X": "carried"},
            str(tmp_path),
        )
    )
    assert code == 7 and out.split() == [str(tmp_path), "carried"]


def test_supervisor_reports_death_by_signal_as_128_plus_n(tmp_path):
    code, _, _ = _supervise(
        ssh.payload(
            [sys.executable, "-c", "import os,signal; os.kill(os.getpid(), signal.SIGKILL)"],
            {},
            str(tmp_path),
        )
    )
    assert code == 128 + signal.SIGKILL


def test_end_of_input_stops_the_worker_and_everything_it_started(tmp_path):
    """What happens when horovodrun stops the job or the ssh connection drops."""
    pidfile = tmp_path / "pids"
    script = (
        "import subprocess,sys,time,os\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pidfile)!r}, 'w').write(f'{{os.getpid()}} {{c.pid}}')\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    code, _, _ = _supervise(
        ssh.payload([sys.executable, "-c", script], {}, str(tmp_path)), close_after=1.5
    )
    assert time.monotonic() - start < 15
    assert code == 128 + signal.SIGTERM
    for pid in map(int, pidfile.read_text().split()):
        with pytest.raises(ProcessLookupError):
            for _ in range(50):  # reaped by now or very soon
                os.kill(pid, 0)
                time.sleep(0.1)


def test_a_missing_command_is_exit_127_with_its_name(tmp_path):
    code, _, err = _supervise(ssh.payload(["/no/such/prog"], {}, str(tmp_path)))
    assert code == 127 and "/no/such/prog" in err


def test_a_missing_directory_runs_in_home_and_says_so(tmp_path):
    code, _, err = _supervise(ssh.payload([sys.executable, "-c", "pass"], {}, "/no/such/dir"))
    assert code == 0 and "working directory" in err


def test_launcher_address_from_interface_list_or_route():
    lo = [n for n, a in ipv4_addresses().items() if a == "127.0.0.1"]
    assert lo, "this machine has a loopback interface"
    assert ssh.launcher_address(["ignored"], ["nosuch0", lo[0]]) == "127.0.0.1"
    with pytest.raises(ValueError, match="nosuch0"):
        ssh.launcher_address(["x"], ["nosuch0"])
    assert ssh.launcher_address(["127.0.0.1"], []) == "127.0.0.1"
    with pytest.raises(ValueError, match="does not resolve"):
        ssh.resolve("no-such-host.invalid")


def test_unreachable_hosts_are_named_with_ssh_s_reason():
    # port 1 on loopback: connection refused at once, whatever sshd this machine runs
    bad = ssh.check_reachable(["127.0.0.1"], port=1, timeout=20)
    assert list(bad) == ["127.0.0.1"] and "refused" in bad["127.0.0.1"].lower()


class _Proc:
    pid = 0

    def poll(self):
        return 0


def _worker(rank, code, t, *, stopped=False, stop_time=0.0, remote=False):
    w = Worker(rank, "h", _Proc(), remote=remote)  # type: ignore[arg-type]
    w.exit_code, w.exit_time, w.stopped_by_us, w.stop_time = code, t, stopped, stop_time
    return w


def _job(workers, notes):
    job = Job(
        [Command(w.rank, "h", ["x"], {}) for w in workers], failure_note=lambda r: notes.get(r)
    )
    job.workers = workers
    job.first_failure = min((w for w in workers if w.exit_code), key=lambda w: w.exit_time)
    return job


def test_root_cause_is_the_silent_rank_a_consequence_points_at():
    """Rank 3 (remote) was SIGKILLed; rank 0 noticed first and failed with a Horovod error;
    rank 3's exit reached horovodrun after it had already started stopping everyone."""
    ws = [
        _worker(0, 1, 10.0),
        _worker(1, 143, 10.2, stopped=True, stop_time=10.0),
        _worker(3, 137, 10.1, stopped=True, stop_time=10.0, remote=True),
    ]
    job = _job(ws, {0: ("consequence", "HorovodInternalError: rank 3 exited")})
    assert job.root_cause().rank == 3
    report = job.report()
    assert "Root cause: rank 3 on host h was killed by signal SIGKILL" in report
    assert "rank 0 failed only because it lost this rank" in report


def test_a_rank_killed_a_moment_before_ranks_that_exited_is_the_cause_whatever_the_order():
    """Rank 2 was SIGKILLed; ranks 0 and 1 lost it and exited with code 1 at once, and their
    wait threads got the CPU before rank 2's: nothing recorded why they exited. The silent
    death is the cause (and the job's exit code is its 137); a second later it would not be."""
    ws = [_worker(0, 1, 10.0), _worker(1, 1, 10.01), _worker(2, 137, 10.02)]
    job = _job(ws, {})
    assert job.root_cause().rank == 2
    assert "Root cause: rank 2 on host h was killed by signal SIGKILL" in job.report()
    ws = [_worker(0, 1, 10.0), _worker(1, 1, 10.01), _worker(2, 137, 11.5)]
    assert _job(ws, {}).root_cause().rank == 0
    ws = [_worker(0, 1, 10.0), _worker(2, 137, 10.1, stopped=True, stop_time=10.05)]
    assert _job(ws, {}).root_cause().rank == 0  # one we were stopping is never blamed so


def test_a_rank_we_stopped_is_not_blamed():
    ws = [
        _worker(0, 1, 10.0),
        _worker(1, 143, 10.2, stopped=True, stop_time=10.0),
        _worker(2, 137, 16.0, stopped=True, stop_time=10.0),
    ]  # SIGKILL after the grace
    job = _job(ws, {0: ("consequence", "HorovodInternalError: lost rank 2")})
    assert job.root_cause().rank == 0


def test_an_exception_of_its_own_is_the_root_cause_whatever_the_order():
    ws = [_worker(0, 1, 10.0), _worker(1, 1, 10.5)]
    job = _job(ws, {0: ("consequence", "x"), 1: ("root", "ValueError: bad")})
    assert job.root_cause().rank == 1


def test_exit_descriptions_for_remote_ranks():
    assert "ssh" in exit_description(255, remote=True)
    assert "same path" in exit_description(127, remote=True)
    assert exit_description(255) == "exited with code 255"
