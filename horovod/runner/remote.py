"""The remote end of an ssh-started worker: ``python -m horovod.runner.remote``.

``horovodrun`` starts one of these per remote rank through ``ssh host '<python> -m
horovod.runner.remote'`` and writes one JSON line on its standard input: the working directory,
the worker's environment (with the job secret, which therefore never appears on a command line)
and its argv. The supervisor then

* starts the worker in its own session, with the launcher's environment added to the remote
  login environment, its stdout/stderr going straight back through ssh;
* keeps reading standard input: end of file (horovodrun closed it to stop the job, ssh died, or
  sshd dropped the connection because the launcher's host went away) stops the worker: SIGTERM
  to its process group, SIGKILL after ``HOROVOD_STOP_GRACE_SECONDS`` (default 5);
* on SIGTERM/SIGHUP/SIGINT does the same;
* exits with the worker's status (``128 + N`` when signal N killed it), which ssh hands back to
  horovodrun, and SIGKILLs whatever the worker left running in its session;
* removes shared-memory segments the worker's rank left behind (a rank killed during set-up).

Standard library only: it runs before anything of the job is imported.

Must not touch: the training runtime; processes other than the worker it runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

# The supervisor and horovodrun agree on this first line so a stray shell banner cannot be
# mistaken for the payload.
MAGIC = "pyhorovod-remote-v1"


def _pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class _Stopper:
    def __init__(self, proc: subprocess.Popen, grace: float) -> None:
        self.proc = proc
        self.grace = grace
        self.once = threading.Lock()
        self.started = False

    def stop(self) -> None:
        with self.once:
            if self.started:
                return
            self.started = True
        threading.Thread(target=self._stop, daemon=True).start()

    def _stop(self) -> None:
        _killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(self.grace)
        except subprocess.TimeoutExpired:
            _killpg(self.proc.pid, signal.SIGKILL)


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _watch_stdin(stopper: _Stopper) -> None:
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    stopper.stop()


def parse_payload(line: str) -> dict:
    """The launcher's JSON line -> ``{"cwd", "env", "argv"}``; ValueError names what is wrong."""
    try:
        payload = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"the launcher's payload is not JSON ({e})") from None
    if not isinstance(payload, dict) or payload.get("magic") != MAGIC:
        raise ValueError(
            "the launcher's payload is not from a matching pyhorovod version "
            f"(expected {MAGIC!r}); install the same pyhorovod on every host"
        )
    argv, env = payload.get("argv"), payload.get("env")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError("the launcher's payload has no command")
    if not isinstance(env, dict):
        raise ValueError("the launcher's payload has no environment")
    return payload


def _read_line() -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        c = os.read(0, 1)
        if not c:
            break
        buf += c
    return buf.decode("utf-8", "replace")


def main() -> int:
    try:
        payload = parse_payload(_read_line())
    except ValueError as e:
        print(f"horovod.runner.remote: {e}", file=sys.stderr)
        return 2
    cwd = payload.get("cwd")
    if cwd:
        try:
            os.chdir(cwd)
        except OSError as e:
            print(
                f"horovod.runner.remote: cannot enter the launcher's working directory on "
                f"{os.uname().nodename}: {e.strerror}; running in {os.getcwd()}",
                file=sys.stderr,
            )
    env = dict(os.environ)
    env.update(payload["env"])
    argv = payload["argv"]
    try:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None,
        )
    except OSError as e:
        print(f"horovod.runner.remote: cannot start {argv[0]}: {e.strerror or e}", file=sys.stderr)
        return 127
    grace = float(env.get("HOROVOD_STOP_GRACE_SECONDS") or 5.0)
    stopper = _Stopper(proc, grace)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda *_: stopper.stop())
    threading.Thread(target=_watch_stdin, args=(stopper,), daemon=True).start()
    while True:
        try:
            code = proc.wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
            continue
    _killpg(proc.pid, signal.SIGKILL)  # nothing the worker started outlives it
    secret, rank = env.get("HOROVOD_SECRET_KEY", ""), env.get("HOROVOD_RANK", "")
    if secret and rank.isdigit():
        try:
            from horovod.common.shm_names import cleanup_job

            cleanup_job(bytes.fromhex(secret), int(rank))
        except Exception:
            pass
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
