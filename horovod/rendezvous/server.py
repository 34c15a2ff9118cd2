"""The rendezvous server hosted by horovodrun: ``PUT/GET /<scope>/<key>``.

Every request must carry ``X-Horovod-Auth`` = HMAC(secret, method, path, sha256(body));
anything else gets 403 and changes nothing. Malformed requests get 400, oversized ones 413,
and idle connections are dropped after a timeout, so no peer can disturb the store.

Must not touch: the launcher's processes; anything without a valid HMAC.
"""

from __future__ import annotations

import hmac
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from horovod.rendezvous.store import AUTH_HEADER, request_tag

MAX_BODY = 64 * 1024 * 1024


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 10  # seconds a connection may sit idle
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def _reply(self, code: int, body: bytes = b"") -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _key(self) -> tuple[str, str] | None:
        parts = self.path.split("/")
        if len(parts) != 3 or not parts[1] or not parts[2]:
            return None
        # Clients quote scope and key (``HTTPStoreClient``): store them as the launcher names
        # them, so ``get``/``put`` here see the same keys.
        return urllib.parse.unquote(parts[1]), urllib.parse.unquote(parts[2])

    def _authorised(self, body: bytes) -> bool:
        tag = self.headers.get(AUTH_HEADER, "")
        want = request_tag(self.server.secret, self.command, self.path, body)
        return hmac.compare_digest(tag.encode(), want.encode())

    def _read_body(self) -> bytes | None:
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return None
        if n < 0 or n > MAX_BODY:
            return None
        return self.rfile.read(n) if n else b""

    def do_PUT(self) -> None:
        body = self._read_body()
        key = self._key()
        if body is None or key is None:
            self.close_connection = True
            return self._reply(400)
        if not self._authorised(body):
            self.server.rejected += 1
            return self._reply(403)
        with self.server.lock:
            self.server.data[key] = body
        self._reply(200)

    def do_GET(self) -> None:
        key = self._key()
        if key is None:
            return self._reply(400)
        if not self._authorised(b""):
            self.server.rejected += 1
            return self._reply(403)
        with self.server.lock:
            value = self.server.data.get(key)
        self._reply(200, value) if value is not None else self._reply(404)

    def do_DELETE(self) -> None:
        key = self._key()
        if key is None:
            return self._reply(400)
        if not self._authorised(b""):
            self.server.rejected += 1
            return self._reply(403)
        with self.server.lock:
            self.server.data.pop(key, None)
        self._reply(200)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], secret: bytes) -> None:
        super().__init__(addr, _Handler)
        self.secret = secret
        self.data: dict[tuple[str, str], bytes] = {}
        self.lock = threading.Lock()
        self.rejected = 0

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a broken peer must not print tracebacks into the job's output


class RendezvousServer:
    """Start with ``start()``; ``port`` is then the bound port. Binds all interfaces by
    default so workers on other hosts can reach it."""

    def __init__(self, secret: bytes, host: str = "0.0.0.0", port: int = 0) -> None:
        self._server = _Server((host, port), secret)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="horovod-rendezvous",
            daemon=True,
        )

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def rejected(self) -> int:
        return self._server.rejected

    def get(self, scope: str, key: str) -> bytes | None:
        with self._server.lock:
            return self._server.data.get((scope, key))

    def put(self, scope: str, key: str, value: bytes) -> None:
        with self._server.lock:
            self._server.data[(scope, key)] = bytes(value)

    set = put  # the ``Store`` interface's name, so protocol code runs on the server too

    def start(self) -> RendezvousServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
