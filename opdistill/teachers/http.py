"""The HTTP client under every remote teacher (our server, a stock ``vllm serve``): bearer token, deadlines, retries.

- **A deadline per try, for the whole request.** ``timeout_s`` bounds each try from the first byte sent to the last
  byte of the answer read: connecting, sending, waiting and reading together. httpx's own timeouts are per operation
  (a server that trickles its answer a byte a second never trips a read timeout), so each try runs as a coroutine of
  an ``httpx.AsyncClient`` on this client's event loop (one daemon thread) under ``asyncio.wait_for``, which cancels
  it, and closes its connection, when the time is up. A try that outlives its deadline counts as a failed try.
- **A bounded answer.** The body is read in chunks and refused above ``max_response_bytes`` (default 1 GiB).
- Connection failures, deadlines and 5xx answers are retried with exponential backoff (``backoff_s * 2**i`` before
  try i + 1, each wait capped at :data:`MAX_BACKOFF_S`), then raise :class:`TeacherServiceError` (a
  :class:`~opdistill.errors.UserError`: the CLI prints one line and exits 2) naming the server and the request. A
  4xx answer is not retried: its message comes back in the error. A request therefore ends within
  :func:`worst_case_s` seconds: ``(retries + 1) * timeout_s`` plus the waits (``opdistill check`` states it).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
import time
from opdistill.errors import UserError

MAX_BACKOFF_S = 60.0  # the longest wait between two tries, however many retries


def backoff_wait(backoff_s: float, attempt: int) -> float:
    """The wait before try ``attempt`` + 1 (``attempt`` >= 1): ``backoff_s * 2**(attempt - 1)``, at most
    :data:`MAX_BACKOFF_S`."""
    return min(backoff_s * 2.0 ** min(attempt - 1, 1023), MAX_BACKOFF_S)


def worst_case_s(timeout_s: float, retries: int, backoff_s: float) -> float:
    """The longest a request can take before it gives up: every try to its deadline, every wait in between."""
    return (retries + 1) * timeout_s + sum(backoff_wait(backoff_s, a) for a in range(1, retries + 1))
from opdistill.teachers.base import Teacher

__all__ = ["TeacherServiceError", "TeacherUnavailable", "TeacherChanged", "HttpClient", "HttpTeacher", "MAX_BACKOFF_S",
           "MAX_TOKEN_BYTES", "backoff_wait", "worst_case_s",
           "read_token_file"]

MAX_TOKEN_BYTES = 64 << 10  # a token file's size


def read_token_file(path) -> str:
    """The bearer token in ``path``: one line of printable ASCII, read bounded (``/dev/zero`` would never end).
    ValueError says what is wrong with the file (the caller names the setting); the one reader of the server's
    ``--token-file`` and the client's ``teacher.token_file``."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read the token file ({e.strerror})") from None
    if len(raw) > MAX_TOKEN_BYTES:
        raise ValueError(f"longer than {MAX_TOKEN_BYTES} bytes; a token is one short line of text")
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text ({e.reason} at byte {e.start}); the token is one line of text") from None
    if not token:
        raise ValueError("the token file is empty")
    if not all("!" <= c <= "~" for c in token):
        raise ValueError("the token holds a space, a control or a non-ASCII character; use printable ASCII only (it "
                         "travels in an HTTP header)")
    return token


class TeacherServiceError(UserError, RuntimeError):
    """The teacher service cannot be used: unreachable after the retries, an answer refused (4xx, with the server's
    message), a malformed answer, or a server whose teacher/tokenizer does not match the student (with a diff).
    The message is one line naming the server and the request; the CLI prints it and exits 2."""

    kind = "teacher service error"


class TeacherUnavailable(TeacherServiceError):
    """The server gave no answer after the retries (connection refused or reset, deadlines, 5xx): the one failure a
    pool of servers (``opdistill.teachers.pool``) answers by sending the request to another server. A refusal (4xx)
    or a malformed or invalid answer is a :class:`TeacherServiceError` and is never retried elsewhere. ``reason``:
    what failed without the advice to the user (a pool, which goes on without the server, says only that)."""

    def __init__(self, message: str, *, reason: str | None = None):
        super().__init__(message)
        self.reason = reason if reason is not None else message


class TeacherChanged(TeacherServiceError):
    """A server answered as another teacher than the one accepted at start (an answer's teacher identity or
    ``model`` differs from its ``/info`` then): the answer is refused. A pool takes the server out as it does an
    unavailable one (and probes it back in only as the pool's teacher); a single server stops the run. ``reason``:
    what differs, without the advice to the user."""

    def __init__(self, message: str, *, reason: str | None = None):
        super().__init__(message)
        self.reason = reason if reason is not None else message


def _detail(resp) -> str:
    try:
        d = resp.json()
        if isinstance(d, dict) and isinstance(d.get("error"), dict):  # OpenAI-style {"error": {"message": ...}}
            d = d["error"]
        for field in ("detail", "message"):
            if isinstance(d, dict) and field in d:
                return " ".join(str(d[field]).split())[:500]
    except ValueError:
        pass
    return " ".join(resp.text.split())[:500] or "(empty body)"


class _TooLarge(Exception):
    pass


class HttpClient:
    """``url``: http(s)://host:port (TLS by the scheme); ``token_file``: a file holding the bearer token;
    ``timeout_s``: the deadline of each try, the whole request (module notes); ``retries`` after the first try;
    ``key``: the config key of the url, for messages; ``headers``: sent with every request; ``max_response_bytes``:
    the largest answer read. Counts ``requests`` answered and ``bytes_received``."""

    def __init__(self, url: str, *, token_file: str | None = None, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.5, key: str = "teacher.url", headers: dict | None = None,
                 max_response_bytes: int = 1 << 30):
        import httpx

        self.url = url.rstrip("/")
        self.key = key
        self.timeout_s = float(timeout_s)
        self.retries, self.backoff_s = retries, backoff_s
        self.max_response_bytes = max_response_bytes
        headers = dict(headers or {})
        if token_file is not None:
            try:
                token = read_token_file(token_file)
            except ValueError as e:
                raise TeacherServiceError(f"teacher.token_file={token_file!r}: {e}") from None
            headers["Authorization"] = f"Bearer {token}"
        self._closing = False  # close() began: no further try
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="opdistill-http")
        self._thread.start()
        # per-operation timeouts as well (a connect that hangs fails at once rather than at the deadline's end)
        self._client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=httpx.Timeout(self.timeout_s))
        self.requests = 0
        self.bytes_received = 0

    def where(self) -> str:
        return f"{self.key}={self.url}"

    def _timeout_key(self) -> str:
        section = re.sub(r"\.\d+$", "", self.key)  # teacher.url.1 (one server of a pool): teacher.url
        return section.rsplit(".", 1)[0] + ".timeout_s"

    async def _fetch(self, method: str, path: str, kw: dict):
        """One try: the whole answer, read in chunks (at most ``max_response_bytes``), as an ``httpx.Response``."""
        import httpx

        async with self._client.stream(method, path, **kw) as resp:
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():  # decoded: a compressed answer counts at its decoded size
                size += len(chunk)
                if size > self.max_response_bytes:
                    raise _TooLarge(size)
                chunks.append(chunk)
            headers = [(k, v) for k, v in resp.headers.multi_items()
                       if k.lower() not in ("content-encoding", "content-length")]
            return httpx.Response(resp.status_code, headers=headers, content=b"".join(chunks), request=resp.request)

    def _try(self, method: str, path: str, kw: dict):
        """One try under the deadline (module notes), run on this client's event loop."""
        fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(self._fetch(method, path, kw), self.timeout_s),
                                               self._loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()  # an interrupt in the caller's thread: stop the request too
            raise

    def request(self, method: str, path: str, what: str, **kw):
        """The answer of ``method path`` (``what``: the request in words), retried as the module notes say."""
        import httpx

        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(backoff_wait(self.backoff_s, attempt))
            closed = TeacherUnavailable(f"{self.where()}: {method} {path} ({what}): the client is closed (the run is "
                                        f"stopping)", reason="closed")
            if self._closing:  # closed while retrying: no further try
                raise closed
            try:
                resp = self._try(method, path, kw)
            except concurrent.futures.CancelledError:
                if self._closing:  # close() cancelled it: say so, once
                    raise closed from None
                raise
            except (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException):
                last = (f"no complete answer within {self._timeout_key()}={self.timeout_s:g} s, the deadline of the "
                        f"whole request")
                continue
            except httpx.TransportError as e:  # connect/read errors: retried
                last = f"{type(e).__name__}: {' '.join(str(e).split()) or 'no answer'}"
                continue
            except _TooLarge as e:
                raise TeacherServiceError(f"{self.where()}: {method} {path} ({what}) answered more than "
                                          f"{self.max_response_bytes} bytes ({e.args[0]} read); the answer is refused "
                                          f"(a server of this size of request answers far less)") from None
            if resp.status_code >= 500:
                last = f"HTTP {resp.status_code}: {_detail(resp)}"
                continue
            if 300 <= resp.status_code < 400:  # not followed: the token would travel to wherever it points
                raise TeacherServiceError(f"{self.where()}: {method} {path} ({what}) was redirected (HTTP "
                                          f"{resp.status_code} to {resp.headers.get('location', '?')!r}); redirects "
                                          f"are not followed: set {self.key} to the server's own address")
            if resp.status_code >= 400:
                raise TeacherServiceError(f"{self.where()}: {method} {path} ({what}) was refused: HTTP "
                                          f"{resp.status_code}: {_detail(resp)}")
            self.requests += 1
            self.bytes_received += len(resp.content)
            return resp
        reason = f"{method} {path} ({what}) failed after {self.retries + 1} tries ({last})"
        raise TeacherUnavailable(f"{self.where()}: {reason}; start the teacher server or fix {self.key}, then "
                                 f"continue the run with --resume", reason=reason)

    def close(self) -> None:
        """Cancel the requests in flight (their callers get CancelledError at once, not at their deadline), close
        the connections and the event loop."""
        if self._loop.is_closed():
            return
        self._closing = True

        async def cancel_and_close():  # on the loop: every request cancelled and finished, then the connections
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=5)
            await self._client.aclose()

        try:
            asyncio.run_coroutine_threadsafe(cancel_and_close(), self._loop).result(10)
        except Exception:  # noqa: BLE001 -- closing: the connections go with the loop anyway
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()


class HttpTeacher(Teacher):
    """What every remote teacher shares: its :class:`HttpClient` (``http``), the counts it keeps, closing it."""

    http: HttpClient

    @property
    def requests(self) -> int:
        return self.http.requests

    @property
    def bytes_received(self) -> int:
        return self.http.bytes_received

    def served_by(self) -> "HttpTeacher":
        return self

    def close(self) -> None:
        self.http.close()
