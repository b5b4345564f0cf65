"""Several servers of one teacher (``teacher.url: [url, url, ...]``): :class:`TeacherPool`, a composite Teacher.

- **One teacher, checked.** Every server must serve the same teacher: at start (and whenever a server comes back)
  its identity (``/info`` of our server without its counters; the served model of a stock ``vllm serve``) must equal
  the first answering server's, else the run is refused with the difference. The pool's ``info`` is that identity,
  so a resumed run compares the pool with what it started on like a single server.
- **The same numbers whichever server answers.** A batch's rows are cut into as many contiguous blocks as the config
  lists servers (a count fixed by the config, never by which servers are up or by timing), each block one request;
  every server computes the same bytes for a block (same teacher, same payload), so the scores do not depend on
  which server answered what.
- **One request per server at a time.** The blocks are sent at once, one thread each; a block goes to an idle
  healthy server or waits for one to finish: while every server answers, each scores one block
  of every batch; when one is out, the others take its blocks. A server never holds two of the pool's blocks at
  once (our server merges concurrent requests into one forward, whose float rounding depends on the batch), so
  each block is scored alone, wherever it goes. Block j goes to server j when it is up and idle, else to the next
  idle one in the list.
- **A failed server is taken out, probed back in.** A block whose server gives no answer after its retries
  (:class:`~opdistill.teachers.http.TeacherUnavailable`: connection refused, deadlines, 5xx) is sent to another
  healthy server and the failed one is marked down; a down server is probed (one try of its ``/info`` or
  ``/v1/models``) every ``probe_s`` seconds, in the background, and comes back once it answers as the same teacher.
  A server whose answer comes from another teacher than the pool's
  (:class:`~opdistill.teachers.http.TeacherChanged`: its identity or ``model`` differs from its ``/info`` at start)
  is taken out the same way, its warning naming what differs; it is probed back in only as the pool's teacher.
  A refusal (4xx) or an invalid answer is not a failure of availability: it stops the run as with one server.
- **Each server once.** The entries are resolved at construction (scheme, resolved IP address, port):
  two entries that reach one server (127.0.0.1, localhost and 127.1 on one port) are refused in one line naming
  both (:func:`check_distinct`); one server listed twice would merge the pool's blocks into one forward.
- **Patience.** While every server is down, a block waits, probing them every ``probe_s``, for ``patience_s``
  seconds; then the request fails with one line naming every server (the trainer saves the last completed step).
- **Metrics** (:meth:`TeacherPool.metrics`, since the last call): per server ``i`` (its place in the list)
  ``teacher/server/<i>/requests``, ``positions``, ``seconds`` (wall time of its requests), ``failures``
  (blocks it failed, then sent elsewhere) and ``healthy`` (1 or 0 now), and ``teacher/servers_healthy``.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from opdistill.loss import TeacherScores
from opdistill.teachers.base import Rows, ScoreRequest, Teacher
from opdistill.errors import ConfigError
from opdistill.teachers.http import HttpTeacher, TeacherChanged, TeacherServiceError, TeacherUnavailable

__all__ = ["TeacherPool", "identity", "server_addresses", "check_distinct"]

log = logging.getLogger(__name__)

#: fields of our server's /info that change while it serves (counters), or that name it rather than its teacher
_NOT_IDENTITY = frozenset({"requests", "batches", "model", "answer_identity"})


def identity(info: dict) -> dict:
    """What must be equal on every server of a pool: the teacher, its tokenizer, dtype, engine and limits."""
    if "served" in info:  # a stock vllm serve endpoint: only its served model is known
        return {"served_model": info.get("model")}
    return {k: v for k, v in info.items() if k not in _NOT_IDENTITY}


def server_addresses(url: str) -> set[tuple[str, str, int]]:
    """Where ``url`` connects: ``(scheme, IP address, port)`` for each address its host resolves to (the port by
    default 80 or 443), when that address is the server: the host is an IP address, or resolves to this machine
    (loopback: 127.0.0.1, localhost and 127.1 are one server). A name of another machine stands for itself, as does a
    host that does not resolve now: names that share an address may be different servers behind one proxy (it
    routes by name)."""
    import ipaddress
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    port = parts.port or (443 if scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return {(scheme, host, port)}
    addresses = {ipaddress.ip_address(a[4][0].split("%")[0]) for a in infos}
    try:
        literal = bool(ipaddress.ip_address(host))
    except ValueError:
        literal = False
    if not literal and not all(a.is_loopback for a in addresses):
        return {(scheme, host, port)}
    return {(scheme, a.compressed, port) for a in addresses}


def check_distinct(urls: list[str], key: str) -> None:
    """Refuse (ConfigError, one line naming both entries) two entries of a pool that reach one server: the same
    scheme and port and a resolved address in common (127.0.0.1, localhost and 127.1 are one server)."""
    seen: list[tuple[int, set]] = []
    for i, url in enumerate(urls):
        mine = server_addresses(url)
        for j, other in seen:
            common = sorted(mine & other)
            if common:
                scheme, host, port = common[0]
                raise ConfigError(f"{key}: entries {j} ({urls[j]}) and {i} ({url}) are one server ({scheme}, "
                                  f"{host}, port {port}); list each server of a pool once")
        seen.append((i, mine))


class _Server:
    """One server of the pool and what the pool knows of it."""

    def __init__(self, client: HttpTeacher):
        self.client = client
        self.healthy = True
        self.busy = False  # a request of the pool is on its way to it
        self.next_probe = 0.0  # when a down server is probed next (time.monotonic)
        self.probing = False
        self.last_error = ""
        self.stats = dict(requests=0, positions=0, seconds=0.0, failures=0)


class TeacherPool(Teacher):
    """``clients``: one :class:`~opdistill.teachers.http.HttpTeacher` per server, in the config's order (each with
    its own retries); ``probe_s``: how often a down server is probed; ``patience_s``: how long a request waits while
    every server is down; ``key``: the config key of the list, for messages."""

    def __init__(self, clients: list[HttpTeacher], *, probe_s: float = 10.0, patience_s: float = 60.0,
                 key: str = "teacher.url"):
        if len(clients) < 2:
            raise ValueError(f"TeacherPool: expected at least 2 servers, got {len(clients)}")
        check_distinct([c.url for c in clients], key)
        self.servers = [_Server(c) for c in clients]
        self.probe_s, self.patience_s, self.key = float(probe_s), float(patience_s), key
        self.background = clients[0].background
        self.engine_name = clients[0].engine_name
        self.url = ", ".join(c.url for c in clients)
        self.info: dict | None = None  # the servers' common identity (resume compares it)
        self._check: tuple = ((), {})  # check_student's arguments, reused when a server is probed back in
        self._lock = threading.Condition()
        self._closed = False  # close(): every waiting block gives up at once, no probe starts
        self._executor = ThreadPoolExecutor(len(clients), thread_name_prefix="opdistill-teacher-pool")

    # -- start -----------------------------------------------------------------------------------------------------
    def check_student(self, tokenizer, student=None, **kw) -> dict:
        """Each server's check against the student (its client's ``check_student``) and the pool's identity check.
        A server that does not answer starts down (a warning; it is probed back in); none answering is an error."""
        self._check = ((tokenizer, student), kw)
        down = []
        for s in self.servers:
            try:
                self._admit(s)
            except TeacherUnavailable as e:
                s.healthy, s.last_error, s.next_probe = False, str(e), time.monotonic() + self.probe_s
                down.append(e)
        if len(down) == len(self.servers):
            raise TeacherUnavailable(f"{self.key}: none of the {len(self.servers)} teacher servers answers ("
                                     f"{'; '.join(str(e) for e in down)})")
        for s in self.servers:
            if not s.healthy:
                log.warning("%s: does not answer at start; the run starts on the other servers and probes it every "
                            "%g s", s.client.http.where(), self.probe_s)
        return self.info

    def _admit(self, s: _Server, retries: int | None = None) -> None:
        """Check server ``s`` against the student and the pool's identity (raises on a difference); ``retries``:
        instead of its client's (a probe tries once)."""
        (args, kw), http = self._check, s.client.http
        saved = http.retries
        http.retries = http.retries if retries is None else retries
        try:
            s.client.info = None  # read it again: the server may have been restarted with another teacher
            info = s.client.check_student(*args, **kw)
        finally:
            http.retries = saved
        mine = identity(info)
        if self.info is None:
            self.info = dict(info) if "served" in info else mine
            return
        ref = identity(self.info)
        diff = sorted(f for f in set(mine) | set(ref) if mine.get(f) != ref.get(f))
        if diff:
            parts = ", ".join(f"{f}: {_short(ref.get(f))!r} here, {_short(mine.get(f))!r} there" for f in diff[:4])
            raise TeacherServiceError(f"{http.where()}: serves another teacher than the pool's other servers ({parts}"
                                      f"); every server of {self.key} must serve the same teacher")

    # -- health ------------------------------------------------------------------------------------------------------
    def _probe_due(self) -> None:
        """Probe, in the background, each down server whose time has come (one try)."""
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return
            due = [s for s in self.servers if not s.healthy and not s.probing and s.next_probe <= now]
            for s in due:
                s.probing = True
        for s in due:
            threading.Thread(target=self._probe, args=(s,), daemon=True, name="opdistill-teacher-probe").start()

    def _probe(self, s: _Server) -> None:
        error = None
        try:
            self._admit(s, retries=0)
        except TeacherUnavailable as e:
            error = e
        except Exception as e:  # noqa: BLE001 -- another teacher now: kept out, said once per probe
            error = e
            if not self._closed:  # a probe the closing cut short is no news
                log.error("%s", e)
        with self._lock:
            s.probing = False
            if error is None:
                s.healthy, s.last_error = True, ""
                log.warning("%s: answers again; back in the pool", s.client.http.where())
            else:
                s.next_probe = time.monotonic() + self.probe_s
            self._lock.notify_all()

    def _take(self, prefer: int, deadline_from: list) -> _Server:
        """An idle healthy server (``prefer``, else the next listed after it), busy from now; while every healthy
        server is busy, wait for one; while none is healthy, wait (probing) up to ``patience_s``, then raise."""
        with self._lock:
            while True:
                if self._closed:  # the run is stopping (a second Ctrl-C): do not wait out the patience
                    raise TeacherUnavailable(f"{self.key}: the pool is closed (the run is stopping)")
                up = [i for i, s in enumerate(self.servers) if s.healthy]
                n = len(self.servers)
                idle = sorted((i for i in up if not self.servers[i].busy), key=lambda i: (i - prefer) % n)
                if idle:
                    s = self.servers[idle[0]]
                    s.busy = True
                    return s
                if up:
                    self._lock.wait()  # a healthy server is busy: it is free when its request ends
                    continue
                if not deadline_from:
                    deadline_from.append(time.monotonic())
                waited = time.monotonic() - deadline_from[0]
                if waited >= self.patience_s:
                    errors = "; ".join(s.last_error or f"{s.client.http.where()}: down" for s in self.servers)
                    raise TeacherUnavailable(f"{self.key}: every teacher server is down, none came back within "
                                             f"{self.key.rsplit('.', 1)[0]}.patience_s={self.patience_s:g} s "
                                             f"({errors})")
                self._probe_due()  # the lock is reentrant; the probes take it once this thread waits
                self._lock.wait(min(self.probe_s, self.patience_s - waited, 1.0))

    def _release(self, s: _Server, *, failed: TeacherServiceError | None = None, seconds: float | None = None,
                 positions: int = 0) -> None:
        """``s`` is free again: after a failure to answer (taken out), an answer (counted), or neither (an error
        that is not the server's availability: not counted)."""
        with self._lock:
            s.busy = False
            if failed is not None:
                s.stats["failures"] += 1
                if s.healthy:
                    s.healthy, s.last_error = False, str(failed)
                    s.next_probe = time.monotonic() + self.probe_s
                    log.warning("%s: taken out of the pool (%s); its requests go to the other servers and the run "
                                "goes on", s.client.http.where(), " ".join(failed.reason.split())[:300])
            elif seconds is not None:
                st = s.stats
                st["requests"] += 1
                st["positions"] += positions
                st["seconds"] += seconds
            self._lock.notify_all()

    # -- scoring -----------------------------------------------------------------------------------------------------
    def _score_block(self, prefer: int, rows: Rows, request: ScoreRequest) -> TeacherScores:
        positions = int(rows.scored().sum())
        deadline_from: list = []
        while True:
            s = self._take(prefer, deadline_from)
            t0 = time.perf_counter()
            try:
                scores = s.client.score(rows, request)
            except (TeacherUnavailable, TeacherChanged) as e:  # no answer, or another teacher's: refused
                self._release(s, failed=e)
                continue  # to another server
            except BaseException:
                self._release(s)
                raise
            self._release(s, seconds=time.perf_counter() - t0, positions=positions)
            return scores

    def score(self, rows: Rows, request: ScoreRequest) -> TeacherScores:
        self._probe_due()
        if request.hidden:  # one copy of the teacher's head for every server (their lm_head_sha256 are equal)
            self._share_head()
        B = rows.num_rows
        blocks = [b for b in torch.tensor_split(torch.arange(B), min(len(self.servers), B)) if b.numel()]
        if len(blocks) == 1:
            return self._score_block(0, rows, request)
        what = request.what or rows.describe()
        futures = [self._executor.submit(self._score_block, j, rows.select(b),
                                         request.select(b, f"{what} [rows {int(b[0])}:{int(b[-1]) + 1}]"))
                   for j, b in enumerate(blocks)]
        parts = [f.result() for f in futures]
        return TeacherScores.join(parts, torch.cat(blocks))

    def _share_head(self) -> None:
        have = next((s.client for s in self.servers if getattr(s.client, "_head", None) is not None), None)
        if have is None:
            have = next(s.client for s in self.servers if s.healthy)
            have.head  # noqa: B018 -- fetched (and checked) once
        for s in self.servers:
            if getattr(s.client, "_head", None) is None:
                s.client._head = have._head

    # -- the rest of the interface -----------------------------------------------------------------------------------
    @property
    def limits(self) -> dict:
        return self.servers[0].client.limits

    def metrics(self) -> dict[str, float]:
        """Per server, what it did since the last call (module notes), and how many servers are healthy now."""
        out: dict[str, float] = {}
        with self._lock:
            for i, s in enumerate(self.servers):
                p = f"teacher/server/{i}/"
                for name, v in s.stats.items():
                    out[p + name] = float(v)
                    s.stats[name] = 0.0 if name == "seconds" else 0
                out[p + "healthy"] = float(s.healthy)
            out["teacher/servers_healthy"] = float(sum(s.healthy for s in self.servers))
        return out

    @property
    def requests(self) -> int:
        return sum(s.client.requests for s in self.servers)

    @property
    def bytes_received(self) -> int:
        return sum(s.client.bytes_received for s in self.servers)

    def served_by(self) -> "TeacherPool":
        return self  # its url (every server's) and info (their common identity)

    def close(self) -> None:
        """Stop at once: the blocks waiting for a server give up (no patience waited out), no probe starts, the
        queued blocks are cancelled, each client closed (its requests in flight cancelled)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._executor.shutdown(wait=False, cancel_futures=True)
        for s in self.servers:
            s.client.close()


def _short(v):
    return v[:12] if isinstance(v, str) and len(v) == 64 else v
