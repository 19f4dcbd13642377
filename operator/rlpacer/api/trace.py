"""Response-length traces: the JSONL a job records of every response, and the groups a replay
reads from it or from a recorded veRL trace.

**The format a job records** (``rlpacer run``: ``OUT/trace.jsonl``; a cluster job: one
``trace-attempt<N>.jsonl`` per attempt in its checkpoint volume). The first line is a header,
every other line one response of one round, written when the round ends::

    {"format": "rlpacer-response-trace", "version": 1, "max_tokens": 256, "prompts": 4096,
     "prompts_per_step": 16, "seed": 0}
    {"attempt": 0, "step": 3, "round": 5, "kind": "short", "epoch": 0, "prompt": 17,
     "index": 2, "engine": 1, "prompt_tokens": 31, "length": 48, "start_s": 12.031,
     "finish_s": 12.874, "outcome": "kept"}

``round`` counts the job's rounds (a step has one round, more with DAPO refills); ``index`` is
the response's index in its prompt's launch; ``engine`` the rollout replica that served it;
``start_s``/``finish_s`` seconds since the attempt started, ``finish_s`` when the driver saw
the response end (finished, aborted or deferred). ``outcome``:

* ``kept``: finished and kept for its prompt's group (trained, unless DAPO's dynamic sampling
  drops the whole group for equal rewards);
* ``discarded``: finished but not kept (its group already had G, its prompt was deferred
  after it finished, or the round had completed);
* ``aborted``: stopped before it finished (the round completed without it); ``length`` null;
* ``deferred``: stopped because tail batching deferred its prompt to a long round; ``length``
  null.

Readers ignore fields they do not know (a later version may add some); a change an older
reader cannot ignore takes a new ``version``.

**Replay groups.** :func:`read_trace` turns a trace into :class:`TraceGroup` rows, one per
prompt group: for the format above, the finished lengths (kept and discarded) of the round in
which each (epoch, prompt) was kept, the last attempt's when a resumed attempt ran it again;
for a veRL trace (the shipped ``traces/*.jsonl``: ``{"input": prompt tokens,
"output": [lengths], ...}`` per prompt group), each line. A group recorded with tail batching
on is *censored*: its aborted responses (the slowest of a short round) have no length, so its
lengths lean short; :attr:`Trace.censored` counts them. Record with tail batching off for an
uncensored trace.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT = "rlpacer-response-trace"
VERSION = 1
OUTCOMES = ("kept", "discarded", "aborted", "deferred")
ROUND_KINDS = ("short", "long")


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class ResponseRecord:
    """One response of a recorded trace (see the module docstring)."""

    attempt: int
    step: int
    round: int
    kind: str
    epoch: int
    prompt: int
    index: int
    engine: int | None
    prompt_tokens: int
    length: int | None
    start_s: float
    finish_s: float
    outcome: str

    def to_json(self) -> str:
        d = asdict(self)
        d["start_s"] = round(self.start_s, 4)
        d["finish_s"] = round(self.finish_s, 4)
        return json.dumps(d, separators=(", ", ": "))


def header(*, max_tokens: int, prompts: int, prompts_per_step: int, seed: int) -> str:
    """The first line of a recorded trace."""
    return json.dumps({"format": FORMAT, "version": VERSION, "max_tokens": max_tokens,
                       "prompts": prompts, "prompts_per_step": prompts_per_step, "seed": seed},
                      separators=(", ", ": "))


@dataclass(frozen=True)
class TraceGroup:
    """One prompt group of a trace: its prompt's tokens and its responses' lengths."""

    prompt_tokens: int
    lengths: tuple[int, ...]
    key: str
    """Where it came from: ``line 12`` (veRL) or ``epoch 0 prompt 17`` (recorded)."""
    prompt: int | None = None
    """The recorded job's prompt id (rlpacer traces; None for veRL)."""
    epoch: int | None = None
    """The epoch it was trained in (rlpacer traces; None for veRL)."""
    censored: int = 0
    """Its responses of that round with no length (aborted or deferred)."""


@dataclass
class Trace:
    """The groups of one trace, in recorded order, and what was learnt reading it."""

    name: str
    kind: str
    """``verl`` or ``rlpacer``."""
    groups: list[TraceGroup]
    max_tokens: int | None = None
    """The recorded job's response cap (rlpacer traces), else None."""
    censored: int = 0
    """Responses of the replayed groups with no length (aborted or deferred)."""
    responses: int = 0
    """Lines read (veRL: lengths read)."""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def group_size(self) -> int:
        """The most common recorded group size."""
        sizes = [len(g.lengths) for g in self.groups]
        return max(set(sizes), key=sizes.count)


def _int(rec: dict[str, Any], key: str, at: str, *, minimum: int = 0) -> int:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise TraceError(f"{at}: {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def _opt_int(rec: dict[str, Any], key: str, at: str, *, minimum: int = 0) -> int | None:
    if rec.get(key) is None:
        return None
    return _int(rec, key, at, minimum=minimum)


def _num(rec: dict[str, Any], key: str, at: str) -> float:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
        raise TraceError(f"{at}: {key!r} must be a number >= 0, got {v!r}")
    return float(v)


def _records(lines: Iterable[str], name: str) -> Iterable[tuple[str, dict[str, Any]]]:
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        at = f"{name}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise TraceError(f"{at}: not JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(rec, dict):
            raise TraceError(f"{at}: a line must be a JSON object, got {type(rec).__name__}")
        yield at, rec


def read_trace(lines: Iterable[str], name: str = "trace") -> Trace:
    """Reads a recorded rlpacer trace or a veRL trace (which, from its first line)."""
    recs = iter(_records(lines, name))
    first = next(recs, None)
    if first is None:
        raise TraceError(f"{name}: empty: no line to read")
    at, rec = first
    if "format" in rec:
        if rec["format"] != FORMAT:
            raise TraceError(f"{at}: unknown trace format {rec['format']!r}; expected {FORMAT!r}"
                             " (a recorded rlpacer trace) or veRL lines with 'input' and 'output'")
        if rec.get("version") != VERSION:
            raise TraceError(f"{at}: trace version {rec.get('version')!r} is not supported;"
                             f" this rlpacer reads version {VERSION}")
        return _read_rlpacer(rec, recs, name)
    if "output" in rec or "input" in rec:
        return _read_verl(first, recs, name)
    hint = (" (this looks like a dynamic-sampling filter log: pass the length trace beside it)"
            if "kept_prompt_indices" in rec else "")
    raise TraceError(f"{at}: neither a recorded rlpacer trace (a header with 'format') nor a veRL"
                     f" length trace (lines with 'input' and 'output'){hint}")


def _read_verl(first: tuple[str, dict[str, Any]],
               rest: Iterable[tuple[str, dict[str, Any]]], name: str) -> Trace:
    groups: list[TraceGroup] = []
    count = 0
    for at, rec in (first, *rest):
        if rec.get("validate") is True:
            continue  # a validation pass's responses: not training rollouts
        out = rec.get("output")
        if not isinstance(out, list) or not out:
            raise TraceError(f"{at}: 'output' must be a non-empty list of response lengths,"
                             f" got {out!r}")
        for v in out:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise TraceError(f"{at}: 'output' holds {v!r}; every length must be an integer"
                                 " >= 1 (tokens)")
        prompt = _int(rec, "input", at)
        groups.append(TraceGroup(prompt, tuple(out), f"line {at.rsplit(':', 1)[1]}"))
        count += len(out)
    if not groups:
        raise TraceError(f"{name}: no training prompt group (every line is a validation pass)")
    return Trace(name, "verl", groups, responses=count)


def _read_rlpacer(head: dict[str, Any], rest: Iterable[tuple[str, dict[str, Any]]],
                  name: str) -> Trace:
    # (epoch, prompt) -> (attempt, round) where it was kept, and every round's records
    kept_in: dict[tuple[int, int], tuple[int, int]] = {}
    # (attempt, round, epoch, prompt) -> response index -> (outcome, length, prompt tokens);
    # a later line for the same response (a run resumed in the same attempt) replaces it
    by_round: dict[tuple[int, int, int, int], dict[int, tuple[str, int | None, int]]] = {}
    order: dict[tuple[int, int], tuple[int, int]] = {}  # (epoch, prompt) -> (epoch, step)
    lines = 0
    for at, rec in rest:
        lines += 1
        outcome = rec.get("outcome")
        if outcome not in OUTCOMES:
            raise TraceError(f"{at}: 'outcome' must be one of {list(OUTCOMES)}, got {outcome!r}")
        if rec.get("kind") not in ROUND_KINDS:
            raise TraceError(f"{at}: 'kind' must be one of {list(ROUND_KINDS)},"
                             f" got {rec.get('kind')!r}")
        attempt, step, rnd, ep, pr, ptok = (
            _int(rec, k, at) for k in ("attempt", "step", "round", "epoch", "prompt",
                                       "prompt_tokens"))
        index = _int(rec, "index", at)
        _opt_int(rec, "engine", at)
        _num(rec, "start_s", at)
        _num(rec, "finish_s", at)
        length: int | None = None
        if outcome in ("kept", "discarded"):
            length = _int(rec, "length", at, minimum=1)
        else:
            _opt_int(rec, "length", at)  # what it had generated, if the writer knew
        by_round.setdefault((attempt, rnd, ep, pr), {})[index] = (outcome, length, ptok)
        if outcome == "kept":
            prev = kept_in.get((ep, pr))
            if prev is None or (attempt, rnd) >= prev:
                kept_in[(ep, pr)] = (attempt, rnd)
                order[(ep, pr)] = (ep, step)
    groups: list[TraceGroup] = []
    censored = 0
    for ep, pr in sorted(kept_in, key=lambda k: (order[k], k[1])):
        attempt, rnd = kept_in[(ep, pr)]
        recs = list(by_round[(attempt, rnd, ep, pr)].values())
        lengths = tuple(ln for _, ln, _ in recs if ln is not None)
        unfinished = sum(1 for _, ln, _ in recs if ln is None)
        censored += unfinished
        groups.append(TraceGroup(recs[0][2], lengths, f"epoch {ep} prompt {pr}", pr, ep,
                                 unfinished))
    if not groups:
        raise TraceError(f"{name}: no kept response: nothing to replay (a trace needs at least"
                         " one finished round)")
    mt = head.get("max_tokens")
    return Trace(name, "rlpacer", groups,
                 max_tokens=mt if isinstance(mt, int) and mt > 0 else None,
                 censored=censored, responses=lines, meta=dict(head))
