"""Rewards scored off the critical path, in worker processes with a hard timeout per call.

Each response is submitted for scoring the moment it finishes, while the rest of the round is
still generating; the driver only waits for whatever is unfinished when the rollout ends (the
``reward`` seconds of a step report are that wait, not the total scoring time).

The pool (:class:`RewardPool`) is ``spec.reward.workers`` processes, started once and reused
for every call. Each is a fresh interpreter (``python -c``, on the driver's ``sys.path``): not a
fork of the driver, which runs Ray and vLLM threads, and without multiprocessing's re-import of
the driver's main module. Each worker imports the reward itself (:func:`reward_fns.load`), so a
user reward ``module:function`` must be importable in the trainer image; if it is not, the pool
fails at start with a :class:`ConfigError` naming ``spec.reward.type``. A dispatcher thread
hands one call at a time to each idle worker and watches the calls' deadlines and the workers'
exits (a pidfd, and the end of the worker's socket):

* a call still running ``timeoutSeconds`` after it reached its worker is a *timeout*: the
  worker is killed (SIGKILL) and replaced;
* a worker that dies mid-call (``os._exit``, a signal, a segfault) is a *crash*; it is replaced;
* a reward that raises, or returns no finite number, is an *error*; its worker lives on.

Each of the three scores ``spec.reward.failureScore`` and is counted (:class:`RewardStats`; the
step record's ``reward_*`` fields). A hung call holds one worker for at most the timeout and
never the others, so later calls keep flowing; a replacement starts in about 0.1 s. The
timeout runs from when a call reaches its worker, not from submission: a backlog behind a hung
call is not itself timed out.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from contextlib import suppress
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

from rlpacer_trainer import reward_fns
from rlpacer_trainer.errors import ConfigError


class RewardTarget(Protocol):
    """What scoring needs of a problem, whatever its source (the tiny task's
    :class:`~rlpacer_trainer.task.Problem`, a data set's row): the prompt text and the
    reference text a reward compares the response with (a reward's ``answer`` argument)."""

    @property
    def prompt(self) -> str: ...

    @property
    def reference(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class RewardCall:
    """One reward call's arguments: ``fn(response, answer, prompt, **meta)``."""

    response: str
    answer: str
    prompt: str = ""
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, response: str, target: RewardTarget) -> RewardCall:
        return cls(response, str(target.reference), str(target.prompt))


@dataclasses.dataclass
class RewardStats:
    """Counters since the pool started; :meth:`minus` gives a step's share."""

    calls: int = 0  # finished calls, any outcome
    timeouts: int = 0  # killed at the deadline
    crashes: int = 0  # the worker died mid-call
    errors: int = 0  # raised, or returned no finite number
    busy_s: float = 0.0  # worker-seconds spent on calls (timeouts count in full)
    restarts: int = 0  # workers started to replace killed or dead ones

    def minus(self, other: RewardStats) -> RewardStats:
        return RewardStats(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                              for f in dataclasses.fields(self)})


class RewardPoolError(RuntimeError):
    """The pool cannot score any more (its workers fail to start again)."""


def check_spec(spec: Any) -> None:
    """Config-load checks of ``spec.reward`` beyond the API model's (which already names the
    field): the built-ins are this trainer's, a user reward's module can be found (it is
    imported in the workers only), a Regex pattern compiles."""
    type_ = str(spec.type)
    if type_ in reward_fns.BUILTINS:
        if type_ == "Regex":
            try:
                reward_fns.regex_reward(spec.pattern or "")
            except Exception as err:
                raise ConfigError(f"spec.reward.pattern: {spec.pattern!r}: {err}") from None
        return
    module, sep, name = type_.partition(":")
    if not sep or not module or not name:
        raise ConfigError(
            f"spec.reward.type: {type_!r} is neither a built-in reward"
            f" ({', '.join(reward_fns.BUILTINS)}) nor module:function")
    try:
        found = importlib.util.find_spec(module)
    except Exception as err:  # a parent package that fails to import
        raise ConfigError(f"spec.reward.type: {type_!r}: cannot find module {module!r}:"
                          f" {type(err).__name__}: {err}") from None
    if found is None:
        raise ConfigError(f"spec.reward.type: {type_!r}: no module {module!r} on the trainer's"
                          " path (a user reward must be importable in the trainer image)")


def _watch_parent() -> None:
    """A worker (even one stuck in a reward) exits when its driver is gone: the driver holds
    the write end of the worker's stdin, which the kernel closes when the driver dies."""

    def watch() -> None:
        with suppress(OSError):
            while os.read(0, 4096):  # fd 0 itself: sys.stdin's lock would stall the exit
                pass
        os._exit(0)

    threading.Thread(target=watch, name="reward-parent-watch", daemon=True).start()


def _worker_main() -> None:
    """A worker process: ``python -c ... FD TYPE PATTERN`` (started by :class:`RewardPool`)."""
    try:
        _serve()
    finally:
        with suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(0)  # no interpreter teardown: the parent-watch thread may still be reading


def _serve() -> None:
    fd, type_, pattern = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    conn = Connection(fd)
    _watch_parent()
    try:
        fn = reward_fns.load(type_, pattern)
    except BaseException as err:
        conn.send(("load_error", str(err)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        cid, call = msg
        try:
            v = float(fn(call.response, call.answer, call.prompt, **call.meta))
            if not math.isfinite(v):
                raise ValueError(f"returned {v}")
            conn.send((cid, "ok", v))
        except Exception as err:
            conn.send((cid, "error", f"{type(err).__name__}: {err}"[:500]))


_WORKER_CODE = "from rlpacer_trainer.rewards import _worker_main; _worker_main()"


@dataclasses.dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    conn: Connection
    sentinel: int | None  # a pidfd: readable once the process has exited (Linux)
    ready: bool = False
    call: int | None = None  # the call id it is running
    started: float = 0.0  # when that call was sent
    born: float = 0.0


class RewardPool:
    """Scores :class:`RewardCall` s in worker processes; see the module docstring.

    ``submit(key, call)`` while generating, ``collect()`` at the round's end: every score
    submitted since the last collect, and the seconds spent waiting for them."""

    def __init__(self, type_: str, *, timeout_s: float, workers: int = 2,
                 failure_score: float = 0.0, pattern: str | None = None,
                 start_timeout_s: float = 120.0) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.type = type_
        self.pattern = pattern
        self.timeout_s = float(timeout_s)
        self.failure_score = float(failure_score)
        self.start_timeout_s = start_timeout_s
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[int, RewardCall]] = collections.deque()
        self._keys: dict[int, Hashable] = {}
        self._done: dict[Hashable, float] = {}
        self._next_id = 0
        self._closed = False
        self._broken: str | None = None
        self._stats = RewardStats()
        self.last_errors: collections.deque[str] = collections.deque(maxlen=8)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        t0 = time.monotonic()
        self._workers = [self._spawn() for _ in range(workers)]
        try:
            self._await_ready()
        except BaseException:
            self._stop_workers()
            raise
        self.start_s = time.monotonic() - t0
        self._thread = threading.Thread(target=self._loop, name="reward-pool", daemon=True)
        self._thread.start()

    @classmethod
    def from_spec(cls, spec: Any, **kw: Any) -> RewardPool:
        """The pool ``spec.reward`` describes (``rlpacer.api.job.RewardSpec``)."""
        return cls(str(spec.type), timeout_s=float(spec.timeout_seconds),
                   workers=int(spec.workers), failure_score=float(spec.failure_score),
                   pattern=spec.pattern, **kw)

    # --- the driver's side --------------------------------------------------------------------
    def submit(self, key: Hashable, call: RewardCall) -> None:
        with self._cv:
            if self._closed:
                raise RewardPoolError("the reward pool is closed")
            cid = self._next_id
            self._next_id += 1
            self._keys[cid] = key
            self._queue.append((cid, call))
        self._wake()

    def collect(self, each: Callable[[dict[Hashable, float]], None] | None = None,
                ) -> tuple[dict[Hashable, float], float]:
        """All scores submitted since the last collect, and the seconds spent waiting.
        ``each``: called (outside the pool's lock) with the scores that finish while it
        waits, as they finish; those are not returned again."""
        t0 = time.monotonic()
        while each is not None:
            with self._cv:
                if not self._keys or self._broken is not None:
                    break
                if not self._done:
                    self._cv.wait(0.5)
                got, self._done = self._done, {}
            if got:
                each(got)
        with self._cv:
            while self._keys and self._broken is None:
                self._cv.wait(0.5)
            if self._broken is not None:
                raise RewardPoolError(self._broken)
            out, self._done = self._done, {}
        return out, time.monotonic() - t0

    def take_ready(self) -> dict[Hashable, float]:
        """The scores finished since the last take or collect, without waiting (a later
        :meth:`collect` returns only the rest)."""
        with self._cv:
            if self._broken is not None:
                raise RewardPoolError(self._broken)
            out, self._done = self._done, {}
        return out

    @property
    def stats(self) -> RewardStats:
        with self._cv:
            return dataclasses.replace(self._stats)

    @property
    def timeouts(self) -> int:
        return self.stats.timeouts

    @property
    def worker_pids(self) -> list[int]:
        return [int(w.proc.pid) for w in self._workers]

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._stop_workers()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- workers ------------------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        """A fresh interpreter (no fork of the driver's threads; no re-import of its main
        module) on the driver's ``sys.path``, so it imports what the driver could."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER_CODE, str(theirs.fileno()), self.type,
                 json.dumps(self.pattern)],
                stdin=subprocess.PIPE, pass_fds=(theirs.fileno(),), env=env)
        finally:
            theirs.close()
        sentinel = None
        with suppress(AttributeError, OSError):
            sentinel = os.pidfd_open(proc.pid)
        return _Worker(proc, Connection(ours.detach()), sentinel, born=time.monotonic())

    @staticmethod
    def _exited(w: _Worker) -> bool:
        return w.proc.poll() is not None

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        for w in self._workers:
            while not w.ready:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RewardPoolError(
                        f"spec.reward.type: {self.type!r}: reward workers did not start in"
                        f" {self.start_timeout_s:.0f} s (a module that hangs on import?)")
                wait(self._waitables(w), left)
                if w.conn.poll():
                    try:
                        kind, detail = w.conn.recv()
                    except (EOFError, OSError):
                        kind, detail = "died", None
                else:
                    kind, detail = ("died", None) if self._exited(w) else ("", None)
                if kind == "load_error":
                    raise ConfigError(str(detail))
                if kind == "died":
                    raise RewardPoolError(
                        f"spec.reward.type: {self.type!r}: a reward worker died at start"
                        f" (exit code {self._exit_code(w)})")
                w.ready = kind == "ready"

    @staticmethod
    def _waitables(w: _Worker) -> list[Any]:
        return [w.conn] if w.sentinel is None else [w.conn, w.sentinel]

    @staticmethod
    def _exit_code(w: _Worker) -> int | None:
        with suppress(subprocess.TimeoutExpired):
            return w.proc.wait(timeout=5)
        return None

    @staticmethod
    def _kill(w: _Worker) -> None:
        if w.proc.poll() is None:
            with suppress(OSError):
                w.proc.kill()  # SIGKILL
        with suppress(subprocess.TimeoutExpired):
            w.proc.wait(timeout=5)
        w.conn.close()
        if w.proc.stdin is not None:
            with suppress(OSError):
                w.proc.stdin.close()
        if w.sentinel is not None:
            with suppress(OSError):
                os.close(w.sentinel)
            w.sentinel = None

    def _stop_workers(self) -> None:
        """Idle workers are asked to exit (a second at most); busy or starting ones killed."""
        asked = []
        for w in self._workers:
            if w.proc.poll() is None and w.call is None and w.ready:
                with suppress(OSError, ValueError):
                    w.conn.send(None)
                    asked.append(w)
        end = time.monotonic() + 1.0
        for w in self._workers:
            if w in asked:
                with suppress(subprocess.TimeoutExpired):
                    w.proc.wait(timeout=max(0.0, end - time.monotonic()))
            self._kill(w)

    def _wake(self) -> None:
        with suppress(OSError, ValueError):
            self._wake_w.send(b"x")

    # --- the dispatcher thread ----------------------------------------------------------------
    def _finish(self, w: _Worker, value: float | None, outcome: str, detail: str = "") -> None:
        cid = w.call
        assert cid is not None
        busy = time.monotonic() - w.started
        w.call = None
        with self._cv:
            s = self._stats
            s.calls += 1
            s.busy_s += busy
            if outcome == "timeout":
                s.timeouts += 1
            elif outcome == "crash":
                s.crashes += 1
            elif outcome == "error":
                s.errors += 1
            if outcome != "ok":
                self.last_errors.append(f"{outcome}: {detail}")
            key = self._keys.pop(cid)
            self._done[key] = self.failure_score if value is None else value
            self._cv.notify_all()

    def _replace(self, w: _Worker) -> None:
        self._kill(w)
        i = self._workers.index(w)
        if self._closed:
            return
        self._workers[i] = self._spawn()
        with self._cv:
            self._stats.restarts += 1

    def _read(self, w: _Worker) -> bool:
        """Handles every message waiting from ``w``; False when its pipe is closed."""
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "ready":
                    w.ready = True
                elif msg[0] == "load_error":  # a replacement that no longer loads
                    self._break(f"spec.reward.type: {self.type!r}: {msg[1]}")
                elif w.call == msg[0]:
                    ok = msg[1] == "ok"
                    self._finish(w, float(msg[2]) if ok else None, "ok" if ok else "error",
                                 "" if ok else str(msg[2]))
        except (EOFError, OSError):
            return False
        return True

    def _break(self, why: str) -> None:
        with self._cv:
            self._broken = why
            self._cv.notify_all()

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as err:  # never leave collect() waiting forever
            self._break(f"reward pool dispatcher failed: {type(err).__name__}: {err}")
            raise

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._closed:
                    return
                sends = []
                for w in self._workers:
                    if w.ready and w.call is None and self._queue:
                        cid, call = self._queue.popleft()
                        w.call, w.started = cid, time.monotonic()
                        sends.append((w, cid, call))
            freed = False
            for w, cid, call in sends:
                try:
                    w.conn.send((cid, call))
                except (OSError, ValueError):
                    pass  # a dead worker: seen below
                except Exception as err:  # e.g. meta that does not pickle: this call only
                    self._finish(w, None, "error", f"cannot send the call: {err}")
                    freed = True
            if freed:
                continue  # the worker is idle again: hand it the next call
            now = time.monotonic()
            deadlines = [w.started + self.timeout_s for w in self._workers if w.call is not None]
            deadlines += [w.born + self.start_timeout_s for w in self._workers if not w.ready]
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            objs: list[Any] = [self._wake_r]
            for w in self._workers:
                objs += self._waitables(w)
            ready = set(wait(objs, timeout))
            if self._wake_r in ready:
                with suppress(OSError, ValueError):
                    while self._wake_r.recv(4096):
                        pass
            for w in list(self._workers):
                exited = w.sentinel is not None and w.sentinel in ready
                if w.conn not in ready and not exited:
                    continue
                if self._read(w) and not exited:
                    continue
                code = self._exit_code(w)
                self._read(w)  # a result sent just before it exited still counts
                if w.call is None and not w.ready:
                    self._break(f"spec.reward.type: {self.type!r}: a replacement reward worker"
                                f" died at start (exit code {code})")
                    return
                self._replace(w)  # first: a step's counts include its restarts
                if w.call is not None:
                    self._finish(w, None, "crash", f"worker exit code {code}")
            now = time.monotonic()
            for w in list(self._workers):
                if not w.ready and now - w.born >= self.start_timeout_s:
                    self._break(f"spec.reward.type: {self.type!r}: a replacement reward worker"
                                f" did not start in {self.start_timeout_s:.0f} s")
                    return
                if w.call is not None and now - w.started >= self.timeout_s:
                    self._replace(w)
                    self._finish(w, None, "timeout", f"over {self.timeout_s:g} s")
