"""Starting a benchmark's worker processes under each framework's own launcher.

Must not touch: the runtime (it only starts processes under each framework's launcher).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile

DEFAULT_TIMEOUT_S = 900.0  # a benchmark run (one configuration, one pass) longer than this hung


def baseline_env(checkout: str) -> dict[str, str]:
    """The environment that makes a worker import horovod from another checkout (``--baseline``
    of the benchmarks): its root first on the path, and not the working directory (which may
    be this checkout). Checked by importing it: a wrong path would silently measure this code
    twice."""
    root = os.path.abspath(checkout)
    env = {"PYTHONPATH": root, "PYTHONSAFEPATH": "1"}
    if not os.path.isfile(os.path.join(root, "horovod", "__init__.py")):
        raise SystemExit(f"--baseline {checkout}: no horovod package there (a checkout's root)")
    got = subprocess.run(
        [sys.executable, "-c", "import horovod; print(horovod.__file__)"],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    if not got.startswith(root + os.sep):
        raise SystemExit(f"--baseline {checkout}: workers would import horovod from {got!r}")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_args(
    module: str, kind: str, model: str, steps: int, warmup: int, batch: int, out: str
) -> list[str]:
    """``python -m`` arguments that run one training-benchmark worker of ``module``."""
    return [
        module,
        "--worker",
        kind,
        "--models",
        model,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--batch-size",
        str(batch),
        "--out",
        out,
    ]


def command(
    launcher: str, np_: int, module_args: list[str], extra_env: dict[str, str] | None = None
) -> tuple[list[str], dict]:
    """The command that runs ``python -m <module_args>`` on ``np_`` ranks with ``launcher``:
    ``horovodrun``, ``torchrun`` (torch.distributed.run), ``mpirun``, ``mpirun-tcp`` (Open MPI
    over TCP alone) or ``none`` (one plain process)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(extra_env or {}))
    # a module, or a script by its path (a worker that a baseline checkout may not have)
    me = [sys.executable, *([] if module_args[0].endswith(".py") else ["-m"]), *module_args]
    if launcher == "none":
        return me, env
    if launcher == "horovodrun":
        return [sys.executable, "-m", "horovod.runner.launch", "-np", str(np_), *me], env
    if launcher == "torchrun":
        env["GLOO_SOCKET_IFNAME"] = "lo"
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={np_}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            "-m",
            *module_args,
        ], env
    if launcher in ("mpirun", "mpirun-tcp"):
        # mpirun-tcp: Open MPI over TCP alone (ob1 with the tcp and self transports)
        transports = ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self"]
        return [
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            str(np_),
            *(transports if launcher == "mpirun-tcp" else ["--mca", "btl", "self,vader,tcp"]),
            *me,
        ], env
    raise ValueError(f"unknown launcher {launcher!r}")


class LaunchFailed(RuntimeError):
    """A benchmark run that crashed (``returncode``) or hung (``hung``, killed after its
    timeout); ``tail``: the last lines it wrote to stderr. The benchmarks record it against that
    configuration and pass, and go on with the others."""

    def __init__(self, what: str, returncode: int | None, tail: str, hung: bool = False):
        self.what, self.returncode, self.tail, self.hung = what, returncode, tail, hung
        status = "hung (killed after its timeout)" if hung else f"exited with {returncode}"
        super().__init__(f"{what} {status}:\n{tail}")

    def summary(self) -> str:
        """One line: how it failed and the last line it printed."""
        last = next((x for x in reversed(self.tail.splitlines()) if x.strip()), "")
        status = "hung" if self.hung else f"exit status {self.returncode}"
        return f"{status}: {last.strip()[:200]}"


def run_process(cmd: list[str], env: dict, timeout: float | None) -> tuple[int | None, str]:
    """Run ``cmd`` in a session of its own; (exit status, the end of stderr). A run past
    ``timeout`` seconds has its whole process group killed (a launcher's workers too) and gives
    None as its status."""
    p = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        _, err = p.communicate(timeout=timeout)
        return p.returncode, err[-3000:]
    except subprocess.TimeoutExpired:
        return None, _kill_group(p)[-3000:]
    finally:
        if p.poll() is None:
            _kill_group(p)


def _kill_group(p: subprocess.Popen) -> str:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return p.communicate()[1] or ""


def run(
    launcher: str,
    np_: int,
    module_args: list[str],
    extra_env: dict[str, str] | None = None,
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> None:
    """Run to completion; one retry (torchrun's port can be taken between pick and bind);
    LaunchFailed with the end of stderr if it fails (or hangs past ``timeout``) twice."""
    for attempt in range(2):
        cmd, env = command(launcher, np_, module_args, extra_env)
        status, tail = run_process(cmd, env, timeout)
        if status == 0:
            return
        if attempt == 1:
            raise LaunchFailed(f"{launcher} with {np_} ranks", status, tail, hung=status is None)


def collect(
    launcher: str, np_: int, module_args: list[str], extra_env: dict[str, str] | None = None
) -> dict:
    """Run ``python -m <module_args> --out FILE`` on ``np_`` ranks (``run``) and return what
    its workers wrote to FILE (``report``)."""
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        run(launcher, np_, [*module_args, "--out", out], extra_env)
        with open(out) as f:
            return json.load(f)  # type: ignore[no-any-return]
    finally:
        os.unlink(out)


def report(path: str, data: dict) -> None:
    """A worker's result for ``collect``: rank 0 passes its figures, the others nothing."""
    if data:
        with open(path, "w") as f:
            json.dump(data, f)
