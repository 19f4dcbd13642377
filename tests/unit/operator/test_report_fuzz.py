"""Property-based fuzzing of the step-report endpoint (the real aiohttp app, in process, over
the in-memory API server): hostile bodies, headers, paths and methods, replays, and many
concurrent reports for one job.

Every answer is a 4xx with a JSON ErrorBody, the idempotent answer for a replay, or 503 only
while not leader / the API server is unavailable; never a 500; and nothing rejected changes
the stored status."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from operator_fakekube import FakeKube
from test_reports import NS, SPEC, Env, add_job, open_env, report
from yarl import URL

from rlpacer.api.protocol import plan_path, steps_path
from rlpacer.operator.runtime import job_path
from rlpacer.operator.settings import OperatorSettings

pytestmark = pytest.mark.unit

T = TypeVar("T")
FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# -- strategies ----------------------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=4),
    max_leaves=20,
)
FIELDS = ["attempt", "step", "groupSize", "roundKind", "lengths", "seconds", "longQueue",
          "nextRoundKind", "reward"]
LENGTH_FIELDS = ["max", "median", "p90", "count", "aborted"]
SECONDS_FIELDS = ["rollout", "reward", "train", "sync"]
numbers = st.one_of(
    st.integers(min_value=-(2**66), max_value=2**66), st.sampled_from([0, -1, 2**63 - 1, 2**63]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e308, -1e308, 5e-324]),
)


@st.composite
def mutated_reports(draw: st.DrawFn, g: int) -> dict[str, Any]:
    """A valid report for step 1 with a few fields replaced, dropped or added."""
    body: dict[str, Any] = json.loads(json.dumps(report(1, g, 20)))
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.sampled_from(["top", "lengths", "seconds", "extra", "drop"]))
        if where == "top":
            body[draw(st.sampled_from(FIELDS))] = draw(st.one_of(numbers, json_values))
        elif where == "lengths" and isinstance(body.get("lengths"), dict):
            body["lengths"][draw(st.sampled_from(LENGTH_FIELDS))] = draw(numbers)
        elif where == "seconds" and isinstance(body.get("seconds"), dict):
            body["seconds"][draw(st.sampled_from(SECONDS_FIELDS))] = draw(numbers)
        elif where == "extra":
            body[draw(st.text(min_size=1, max_size=12))] = draw(json_values)
        elif body:
            body.pop(draw(st.sampled_from(sorted(body))), None)
    return body


raw_bodies = st.one_of(
    st.binary(max_size=300),
    st.sampled_from([
        b"", b"null", b"[]", b"{}", b'"x"', b"1e400", b"NaN", b"-Infinity",
        b'{"attempt": NaN}', b'{"step": -1}', b'{"attempt": 0}' * 3,
        b"[" * 20000 + b"]" * 20000,  # deeper than the parser's recursion limit
        b'{"a":' * 5000 + b"1" + b"}" * 5000,
        b'{"lengths": {"max": -5, "median": -1, "p90": -1, "count": -3}}',
        b'{"attempt": 0, "step": 1, "groupSize": 1e999}',
        b"\xef\xbb\xbf{}",  # a UTF-8 byte-order mark
        b'{"attempt": "\\ud800"}',  # a lone surrogate
    ]),
    json_values.map(lambda v: json.dumps(v).encode()),
)


# -- harness -------------------------------------------------------------------------------

class Fuzz:
    """One operator app and two admitted jobs on a loop of its own, across examples."""

    def __init__(self, cfg: OperatorSettings | None = None) -> None:
        self.cfg = cfg or OperatorSettings(leader_election=False, resync_seconds=3600,
                                           report_rate_per_second=0)  # unlimited
        self.loop = asyncio.new_event_loop()
        self.env: Env
        self.close: Callable[[], Awaitable[None]]

    def run(self, aw: Awaitable[T]) -> T:
        return self.loop.run_until_complete(aw)

    async def _open(self, steps: int = 100) -> None:
        fk = FakeKube()
        add_job(fk, "job", {**SPEC, "steps": steps})
        add_job(fk, "other")
        self.env, self.close = await open_env(fk, self.cfg)
        for name in ("job", "other"):
            rt = await self.env.jobs.get(NS, name)
            assert rt is not None
            await self.env.jobs.reconcile(rt)
        self.tok = await self.env.token("job")
        self.other_tok = await self.env.token("other")
        g = (await self.env.plan("job"))["groupSize"]
        self.first = report(0, g, 20)
        code, self.first_answer = await self.env.post("job", self.first)
        assert code == 200, self.first_answer
        self.g = self.first_answer["groupSize"]

    def __enter__(self) -> Fuzz:
        self.run(self._open())
        return self

    def __exit__(self, *exc: object) -> None:
        self.run(self.close())
        self.loop.close()

    def stored(self) -> dict[str, Any]:
        return {n: json.loads(json.dumps(self.env.status(n))) for n in ("job", "other")}

    async def send(self, method: str, path: str, data: bytes | None,
                   headers: dict[str, str]) -> tuple[int, dict[str, Any] | None, str]:
        r = await self.env.client.request(method, URL(path, encoded=True), data=data,
                                          headers=headers)
        text = await r.text()
        ctype = r.headers.get("Content-Type", "")
        body = json.loads(text) if ctype.startswith("application/json") else None
        return r.status, body, ctype

    def check(self, method: str, path: str, data: bytes | None, headers: dict[str, str],
              allow_ok: bool = True) -> tuple[int, dict[str, Any] | None]:
        before = self.stored()
        code, body, ctype = self.run(self.send(method, path, data, headers))
        assert code != 500 and code < 600, (code, body)
        if code >= 400:
            assert body is not None, (code, ctype)
            assert body["code"] == code and body["reason"] and body["message"], body
            assert code != 503, body  # the leader with a healthy API server
        if code >= 400 or method != "POST":
            assert self.stored() == before, (code, body)
        else:
            assert allow_ok, (code, body)
        return code, body

    def restore(self, stored: dict[str, Any]) -> None:
        """Put the job back to ``stored`` (after a fuzzed body that was a valid report)."""
        self.env.fk.objects[job_path(NS, "job")]["status"] = stored["job"]
        self.env.fk._bump(self.env.fk.objects[job_path(NS, "job")])
        self.env.jobs.forget(NS, "job")

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tok}", "Content-Type": "application/json"}


# -- properties ----------------------------------------------------------------------------

def test_fuzzed_bodies_are_4xx_and_move_nothing() -> None:
    with Fuzz() as fz:
        @FUZZ
        @given(data=raw_bodies)
        def raw(data: bytes) -> None:
            code, body = fz.check("POST", steps_path(NS, "job"), data, fz.auth())
            assert code in (413, 422), (code, body)

        raw()

        @FUZZ
        @given(body=mutated_reports(fz.g))
        def mutated(body: dict[str, Any]) -> None:
            data = json.dumps(body, allow_nan=True).encode()
            before = fz.stored()
            code, _ = fz.check("POST", steps_path(NS, "job"), data, fz.auth())
            if code == 200:  # still a valid report for step 1 (e.g. only unknown fields added)
                fz.restore(before)

        mutated()


def test_huge_and_deep_bodies() -> None:
    with Fuzz() as fz:
        for data in [b" " * (10 * 1024 * 1024), b"[" * (11 * 1024 * 1024),
                     json.dumps({"pad": "x" * (64 * 1024)}).encode(),
                     b"[" * (64 * 1024 - 1)]:
            code, body = fz.check("POST", steps_path(NS, "job"), data, fz.auth())
            assert code in (413, 422), (code, body, len(data))


header_text = st.text(st.characters(min_codepoint=32, max_codepoint=255,
                                    blacklist_characters="\x7f"), max_size=80)


def test_fuzzed_headers_are_401_or_the_answer() -> None:
    with Fuzz() as fz:
        @FUZZ
        @given(auth=st.one_of(
            st.none(), header_text, header_text.map(lambda t: "Bearer " + t),
            st.sampled_from(["Bearer", "Bearer ", "bearer X", "Basic dXNlcjpwYXNz",
                             "Bearer " + "A" * 8000, "Bearer \u00ff\u00fe"]),
            st.just("OTHER"), st.just("MINE_TRAILING")),
            ctype=st.one_of(st.none(), header_text,
                            st.sampled_from(["text/plain", "application/xml",
                                             "application/json; charset=latin-1",
                                             "multipart/form-data; boundary=x"])),
            replay=st.booleans())
        def headers(auth: str | None, ctype: str | None, replay: bool) -> None:
            h: dict[str, str] = {}
            if auth == "OTHER":
                auth = f"Bearer {fz.other_tok}"
            elif auth == "MINE_TRAILING":
                auth = f"Bearer {fz.tok}x"
            if auth is not None:
                h["Authorization"] = auth
            if ctype is not None:
                h["Content-Type"] = ctype
            body = fz.first if replay else {"attempt": 0}
            code, answer = fz.check("POST", steps_path(NS, "job"), json.dumps(body).encode(), h,
                                    allow_ok=replay)
            if code == 200:
                assert answer == fz.first_answer
            else:
                assert code in (401, 422, 429), (code, answer)

        headers()
        # A header line over aiohttp's 8190 bytes is refused by its HTTP parser, before the
        # app: a 400 (plain text; documented), never a 500, nothing changed.
        before = fz.stored()
        h = {"Authorization": "Bearer " + "A" * 10000}
        code, _, _ = fz.run(fz.send("POST", steps_path(NS, "job"), b"{}", h))
        assert code == 400 and fz.stored() == before


names = st.one_of(
    st.text(max_size=70),
    st.sampled_from(["..", ".", "job/..", "../job", "job?x=1", "job#x", "%2e%2e", "JOB",
                     "job ", "job\x00", "a" * 64, "a" * 300, "job/status", "", "team"]),
)


def test_fuzzed_paths_and_methods_are_json_4xx() -> None:
    with Fuzz() as fz:
        @FUZZ
        @given(ns=st.one_of(st.just(NS), names), name=st.one_of(st.just("job"), names),
               method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
               tail=st.sampled_from(["steps", "plan", "step", "", "steps/", "plan/x"]),
               quoted=st.booleans(), use_token=st.booleans())
        def paths(ns: str, name: str, method: str, tail: str, quoted: bool,
                  use_token: bool) -> None:
            q = (lambda s: quote(s, safe="")) if quoted else (lambda s: quote(s, safe="/?#"))
            path = f"/v1/namespaces/{q(ns)}/rltrainingjobs/{q(name)}/{tail}"
            h = fz.auth() if use_token else {}
            data = json.dumps(fz.first).encode() if method != "GET" else None
            code, answer = fz.check(method, path, data, h)
            if code < 400:
                # only the job's own two routes answer, and a POST only with the replay
                assert (ns, name, tail, use_token) == (NS, "job", tail, True), path
                assert tail in ("steps", "plan") and method in ("GET", "POST"), path
            else:
                assert code in (401, 404, 405, 422), (path, code, answer)
            assert len(fz.env.jobs._jobs) <= 2  # nothing cached for names that are no job
            assert len(fz.env.jobs._loading) <= 2

        paths()


def test_replays_get_the_idempotent_answer_and_older_steps_move_nothing() -> None:
    # The driver retries only its last report: a replay of the last accepted step gets its
    # first answer; an older step (a duplicate delayed past the next one) is 422
    # StepOutOfOrder; a changed replay is 422 ConflictingRepeat (or the check it fails).
    with Fuzz() as fz:
        answers: list[tuple[dict[str, Any], dict[str, Any]]] = [(fz.first, fz.first_answer)]

        async def advance(n: int) -> None:
            g = fz.g
            for step in range(1, n):
                rep = report(step, g, 20 if step % 3 else 90)
                code, ans = await fz.env.post("job", rep)
                assert code == 200, ans
                answers.append((rep, ans))
                g = ans["groupSize"]

        fz.run(advance(8))

        @FUZZ
        @given(i=st.integers(0, 7), change=st.one_of(st.none(), st.sampled_from(
            ["longQueue", "reward", "attempt", "groupSize"])))
        def replay(i: int, change: str | None) -> None:
            rep, ans = answers[i]
            if change is not None:
                rep = {**rep, change: rep.get(change, 0) + 1 if change != "reward" else 0.5}
            code, got = fz.check("POST", steps_path(NS, "job"), json.dumps(rep).encode(),
                                 fz.auth(), allow_ok=change is None and i == 7)
            if change is None and i == 7:
                assert (code, got) == (200, ans)
            else:
                assert code == 422, (code, got)
                if change is None:
                    assert got is not None and got["reason"] == "StepOutOfOrder", got

        replay()


def test_a_thousand_concurrent_reports_for_one_job_make_one_step() -> None:
    with Fuzz() as fz:
        async def flood() -> None:
            rep1 = report(1, fz.g, 20)
            results = await asyncio.gather(*(fz.env.post("job", rep1) for _ in range(1000)))
            assert {c for c, _ in results} == {200}, {c for c, _ in results}
            assert all(a == results[0][1] for _, a in results)  # one answer for one step
            assert fz.env.status("job")["step"] == 2
            assert fz.env.metrics.steps.labels(NS, "job")._value.get() == 2

        fz.run(flood())


def test_concurrent_flood_over_the_rate_is_429_with_retry_after() -> None:
    cfg = OperatorSettings(leader_election=False, resync_seconds=3600,
                           report_rate_per_second=20, report_burst=50)
    with Fuzz(cfg) as fz:  # the harness itself made 2 requests (plan, step 0)
        async def flood() -> None:
            rep1 = report(1, fz.g, 20)
            t0 = time.monotonic()

            async def one() -> tuple[int, str | None, dict[str, Any]]:
                r = await fz.env.client.post(steps_path(NS, "job"), json=rep1,
                                             headers=fz.auth())
                return r.status, r.headers.get("Retry-After"), await r.json()

            results = await asyncio.gather(*(one() for _ in range(500)))
            elapsed = time.monotonic() - t0
            ok = [a for c, _, a in results if c == 200]
            assert {c for c, _, _ in results} == {200, 429}
            assert 48 <= len(ok) <= 48 + 20 * elapsed + 1, (len(ok), elapsed)
            assert all(a == ok[0] for a in ok)
            for c, retry, a in results:
                if c == 429:
                    assert a["reason"] == "TooManyRequests" and retry == "1", (retry, a)
            assert fz.env.status("job")["step"] == 2
            assert fz.env.metrics.report_throttled.labels(NS, "job")._value.get() == 500 - len(ok)

        fz.run(flood())


def test_finite_floats_only_in_answers() -> None:
    # every answer to a valid report is standard JSON (no NaN/Infinity leaks into a plan)
    with Fuzz() as fz:
        assert all(math.isfinite(v) for v in (fz.first_answer["lambda"],
                                               fz.first_answer["stragglerRate"]))
        r = fz.run(fz.env.client.get(plan_path(NS, "job"), headers=fz.auth()))
        assert r.status == 200
