"""Rendezvous store clients. ``Store`` is the interface the runtime uses.

Must not touch: transports or the engine (it only stores bytes under keys).
"""

from __future__ import annotations

import hashlib
import http.client
import threading
import time
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from horovod.common.exceptions import RendezvousError
from horovod.common.secret import mac

AUTH_HEADER = "X-Horovod-Auth"
ABANDON_CHECK_S = 0.2


def request_tag(key: bytes, method: str, path: str, body: bytes) -> str:
    return mac(key, method.encode(), path.encode(), hashlib.sha256(body).digest()).hex()


class Store(ABC):
    # Consulted while ``wait`` waits: a reason to give up (e.g. the elastic round this
    # rendezvous belongs to has ended because a member died), or None to keep waiting.
    abandon_if: Callable[[], str | None] | None = None

    @abstractmethod
    def set(self, scope: str, key: str, value: bytes) -> None: ...

    @abstractmethod
    def get(self, scope: str, key: str) -> bytes | None: ...

    def wait(self, scope: str, keys: Sequence[str], timeout: float) -> list[bytes]:
        """Values of all ``keys`` once every one exists; RendezvousError naming the missing
        keys after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        found: dict[str, bytes] = {}
        delay = 0.002
        next_check = time.monotonic() + ABANDON_CHECK_S
        while True:
            for k in keys:
                if k not in found:
                    v = self.get(scope, k)
                    if v is not None:
                        found[k] = v
            if len(found) == len(keys):
                return [found[k] for k in keys]
            if self.abandon_if is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + ABANDON_CHECK_S
                why = self.abandon_if()
                if why:
                    raise RendezvousError(f"gave up waiting in scope '{scope}': {why}")
            if time.monotonic() >= deadline:
                missing = [k for k in keys if k not in found]
                raise RendezvousError(
                    f"timed out after {timeout:g} s waiting for {len(missing)} of {len(keys)} "
                    f"rendezvous keys in scope '{scope}': {', '.join(missing[:8])}"
                    f"{' ...' if len(missing) > 8 else ''}. Those ranks did not start or could "
                    "not reach the rendezvous server; raise HOROVOD_GLOO_TIMEOUT_SECONDS if they "
                    "are just slow to start."
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


class MemoryStore(Store):
    """Thread-safe in-process store (size-1 runs and thread-based multi-rank tests)."""

    def __init__(self) -> None:
        self._data: dict[tuple[str, str], bytes] = {}
        self._lock = threading.Lock()

    def set(self, scope: str, key: str, value: bytes) -> None:
        with self._lock:
            self._data[(scope, key)] = bytes(value)

    def get(self, scope: str, key: str) -> bytes | None:
        with self._lock:
            return self._data.get((scope, key))


class HTTPStoreClient(Store):
    """Client of ``horovod.rendezvous.server.RendezvousServer``; every request carries an HMAC
    of the method, path and body under the job secret."""

    def __init__(
        self, addr: str, port: int, secret: bytes, *, retries: int = 5, timeout: float = 10.0
    ) -> None:
        self.addr, self.port, self.secret = addr, port, secret
        self.retries, self.timeout = retries, timeout

    def _request(self, method: str, scope: str, key: str, body: bytes = b"") -> tuple[int, bytes]:
        path = "/" + urllib.parse.quote(scope, safe="") + "/" + urllib.parse.quote(key, safe="")
        headers = {
            AUTH_HEADER: request_tag(self.secret, method, path, body),
            "Content-Length": str(len(body)),
        }
        last: Exception | None = None
        for attempt in range(self.retries):
            conn = http.client.HTTPConnection(self.addr, self.port, timeout=self.timeout)
            try:
                conn.request(method, path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                if resp.status == 403:
                    raise RendezvousError(
                        f"the rendezvous server at {self.addr}:{self.port} refused this worker: "
                        "HOROVOD_SECRET_KEY does not match the job's secret"
                    )
                if resp.status in (200, 404):
                    return resp.status, data
                last = RendezvousError(f"HTTP {resp.status}: {data[:200]!r}")
            except (OSError, http.client.HTTPException) as e:
                last = e
            finally:
                conn.close()
            time.sleep(min(0.05 * 2**attempt, 1.0))
        raise RendezvousError(
            f"cannot reach the rendezvous server at {self.addr}:{self.port} "
            f"(HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT): {last}"
        )

    def set(self, scope: str, key: str, value: bytes) -> None:
        self._request("PUT", scope, key, bytes(value))

    def get(self, scope: str, key: str) -> bytes | None:
        status, data = self._request("GET", scope, key)
        return data if status == 200 else None
