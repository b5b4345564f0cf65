"""The HTTP client under every remote teacher (our server, a stock ``vllm serve``): bearer token, timeouts, retries.

Connection failures, timeouts and 5xx answers are retried with exponential backoff (``backoff_s * 2**i`` before try
i + 1) and then raise :class:`TeacherServiceError` (a :class:`~opdistill.errors.UserError`: the CLI prints one line
and exits 2) naming the server and the request. A 4xx answer is not retried: its message comes back in the error.
"""
from __future__ import annotations

import time
from pathlib import Path

from opdistill.errors import UserError
from opdistill.teachers.base import Teacher

__all__ = ["TeacherServiceError", "HttpClient", "HttpTeacher"]


class TeacherServiceError(UserError, RuntimeError):
    """The teacher service cannot be used: unreachable after the retries, an answer refused (4xx, with the server's
    message), a malformed answer, or a server whose teacher/tokenizer does not match the student (with a diff).
    The message is one line naming the server and the request; the CLI prints it and exits 2."""

    kind = "teacher service error"


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


class HttpClient:
    """``url``: http(s)://host:port (TLS by the scheme); ``token_file``: a file holding the bearer token;
    ``timeout_s`` per request; ``retries`` after the first try; ``key``: the config key of the url, for messages;
    ``headers``: sent with every request. Counts ``requests`` answered and ``bytes_received``."""

    def __init__(self, url: str, *, token_file: str | None = None, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.5, key: str = "teacher.url", headers: dict | None = None):
        import httpx

        self.url = url.rstrip("/")
        self.key = key
        self.retries, self.backoff_s = retries, backoff_s
        headers = dict(headers or {})
        if token_file is not None:
            try:
                token = Path(token_file).read_bytes().decode("utf-8").strip()
            except OSError as e:
                raise TeacherServiceError(f"teacher.token_file={token_file!r}: cannot read the token file "
                                          f"({e.strerror})") from None
            except UnicodeDecodeError as e:
                raise TeacherServiceError(f"teacher.token_file={token_file!r}: not UTF-8 text ({e.reason} at byte "
                                          f"{e.start}); the token is one line of text") from None
            if not token:
                raise TeacherServiceError(f"teacher.token_file={token_file!r}: the token file is empty")
            if not all("!" <= c <= "~" for c in token):
                raise TeacherServiceError(f"teacher.token_file={token_file!r}: the token holds a space, a control or "
                                          f"a non-ASCII character; use printable ASCII only (it travels in an HTTP "
                                          f"header)")
            headers["Authorization"] = f"Bearer {token}"
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)
        self.requests = 0
        self.bytes_received = 0

    def where(self) -> str:
        return f"{self.key}={self.url}"

    def request(self, method: str, path: str, what: str, **kw):
        """The answer of ``method path`` (``what``: the request in words), retried as the module notes say."""
        import httpx

        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = self._client.request(method, path, **kw)
            except httpx.TransportError as e:  # connect/read errors and timeouts: retried
                last = f"{type(e).__name__}: {' '.join(str(e).split()) or 'no answer'}"
                continue
            if resp.status_code >= 500:
                last = f"HTTP {resp.status_code}: {_detail(resp)}"
                continue
            if resp.status_code >= 400:
                raise TeacherServiceError(f"{self.where()}: {method} {path} ({what}) was refused: HTTP "
                                          f"{resp.status_code}: {_detail(resp)}")
            self.requests += 1
            self.bytes_received += len(resp.content)
            return resp
        raise TeacherServiceError(f"{self.where()}: {method} {path} ({what}) failed after {self.retries + 1} tries "
                                  f"({last}); start the teacher server or fix {self.key}, then continue the run with "
                                  f"--resume")

    def close(self) -> None:
        self._client.close()


class HttpTeacher(Teacher):
    """What every remote teacher shares: its :class:`HttpClient` (``http``), the counts it keeps, closing it."""

    http: HttpClient

    @property
    def requests(self) -> int:
        return self.http.requests

    @property
    def bytes_received(self) -> int:
        return self.http.bytes_received

    def close(self) -> None:
        self.http.close()
