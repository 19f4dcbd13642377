"""Event-driven simulation of one rollout round on N continuous-batching engines.

The round is driven by the real :class:`rlpacer.control.tail_batching.TailBatchingPlanner`:
every response that finishes is reported to it in finish order, and its decisions (abort
these responses, defer these prompts, the round is complete) are applied at that instant.

Engines advance as a fluid between events: all running sequences on an engine emit one token
per decode step, so an engine's state is a token counter ``n`` and a step costs
``CostProfile.step_s(b, kv)`` with ``kv = sum_offsets + b * n`` (every running sequence's
context grows by one token per step). Time between events is the closed-form integral of that
cost; an abort at a given time inverts it. Events are a sequence finishing, the KV cache
filling (preempt the latest admitted sequences), and aborts from the planner. A prompt's
responses all go to one engine (prefix sharing); prompts are spread round-robin.

**Engines joining mid-round** (an elastic long round whose added replicas become ready after
the round started on the replicas already there): at the join time the driver moves a share
of the unfinished requests to each new engine so that every engine holds about the same
number (``unfinished // engines`` each; counts, not tokens: nobody knows the lengths yet).
Each share is taken from the engine holding the most, queued requests first (nothing lost),
then the most recently admitted running ones (the least generated, so the least to
recompute); a moved running request is aborted on its engine and resumed on the new one with
its generated tokens, paying their prefill again (as after a preemption: no KV transfer).

**Giving the added engines back** (``release_base``, the driver's
``tailBatching.longRound.releaseWhenFits``, ``Driver._release_if_fits``): the round's first
``release_base`` engines are the rollout's own, the rest were added for it. After each event,
once no join is pending and the round's unfinished requests fit on the own engines at the
load each engine began the round with (``ceil(requests / engines)`` at the start, or
``ceil(unfinished / engines)`` after a join), the added engines' unfinished requests move to
the own engines, each to the least loaded (queued or running, lowest index on a tie), running
ones with their generated tokens (their prefill paid again), and the added engines leave the
round: their time counts in its busy fraction up to then, not after.

**Engines of another kind beside the round's** (``side``, :class:`SideEngines`; the driver's
filled long round on wide engines, ``Driver._engines_for``): the round's own engines serve
every prompt but the side's, the side engines (another cost profile: the rollout's own
engines while wide ones run the long round) serve only the side's prompts (a filled long
round's fill), each class spread round-robin over its engines in the planner's order.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

from rlpacer.control.tail_batching import TailBatchingPlanner
from rlpacer.sim.cost import CostProfile

_EPS = 1e-9
# After a KV overflow, preempt until usage is this far below capacity (batches preemptions as
# vLLM's scheduler does within one step, and keeps the event count bounded).
_PREEMPT_HEADROOM = 0.02


@dataclass(frozen=True)
class SideEngines:
    """Engines of another cost profile that serve only ``prompts`` of a round (module doc)."""

    prof: CostProfile
    engines: int
    sat_batch: int
    prompts: frozenset[int]


@dataclass(frozen=True)
class RoundOutcome:
    rollout_s: float
    busy_fraction: float
    kept_lengths: list[int]
    aborted: int
    preemptions: int
    moved: int = 0
    """Requests moved to engines that joined mid-round."""
    joined: int = 0
    """Engines that joined mid-round (0 when the round ended before they were ready)."""
    group_done: tuple[tuple[float, int, int], ...] = ()
    """Per complete group, in completion order: (seconds into the round when its last kept
    response finished, its kept responses' tokens, their count)."""
    released_at: float | None = None
    """Seconds into the round when the added engines were given back (``release_base``);
    None when they stayed to its end."""
    moved_back: int = 0
    """Requests moved from the added engines to the own ones at the release."""


class _Engine:
    __slots__ = (
        "b", "busy", "cap", "heap", "n", "next_n", "next_overflow", "next_t", "prof", "running",
        "sat", "sum_off", "t", "t0", "waiting",
    )

    def __init__(self, prof: CostProfile, sat: int, t0: float = 0.0) -> None:
        self.prof = prof
        self.sat = float(sat)
        self.cap = float(prof.kv_capacity_tokens)
        self.t = t0
        self.t0 = t0  # when the engine joined the round
        self.n = 0.0
        self.b = 0
        self.sum_off = 0.0
        self.running: dict[int, tuple[float, float]] = {}  # rid -> (kv offset, finish counter)
        self.heap: list[tuple[float, int]] = []
        self.waiting: deque[int] = deque()
        self.busy = 0.0
        self.next_t = math.inf
        self.next_n = math.inf
        self.next_overflow = False

    def _cost_at(self, n: float) -> float:
        p = self.prof
        return p.base_s + p.per_seq_s * self.b + p.per_kv_token_s * (self.sum_off + self.b * n)

    def _time_between(self, n0: float, n1: float) -> float:
        p = self.prof
        return self._cost_at(n0) * (n1 - n0) + 0.5 * p.per_kv_token_s * self.b * (n1 - n0) ** 2

    def advance_time(self, t: float) -> None:
        """Bring the engine's clock to ``t`` (no event in between)."""
        dt = t - self.t
        if dt <= 0:
            return
        if self.b:
            bcost = self._cost_at(self.n)
            a2 = self.prof.per_kv_token_s * self.b
            x = 2 * dt / (bcost + math.sqrt(bcost * bcost + 2 * a2 * dt))
            self.n = min(self.n + x, self.next_n)
            self.busy += (self.b / self.sat if self.b < self.sat else 1.0) * dt
        self.t = t

    def advance_counter(self, n1: float) -> None:
        if self.b and n1 > self.n:
            dt = self._time_between(self.n, n1)
            self.busy += (self.b / self.sat if self.b < self.sat else 1.0) * dt
            self.t += dt
        self.n = max(self.n, n1)

    def usage(self) -> float:
        return self.sum_off + self.b * self.n

    def start(self, rid: int, prompt_len: int, generated: int, length: int) -> None:
        ctx = prompt_len + generated
        off = ctx - self.n
        fin = self.n + (length - generated)
        self.running[rid] = (off, fin)
        heapq.heappush(self.heap, (fin, rid))
        self.b += 1
        self.sum_off += off
        stall = self.prof.prefill_s_per_token * ctx
        self.t += stall
        self.busy += stall

    def remove(self, rid: int) -> float:
        """Stop a running sequence; returns its kv offset."""
        off, _ = self.running.pop(rid)
        self.b -= 1
        self.sum_off -= off
        return off

    def refresh(self) -> None:
        """Recompute the next event (finish or KV overflow)."""
        heap, running = self.heap, self.running
        while heap and (heap[0][1] not in running or running[heap[0][1]][1] != heap[0][0]):
            heapq.heappop(heap)
        if not self.b:
            self.next_t, self.next_n, self.next_overflow = math.inf, math.inf, False
            return
        n_fin = heap[0][0]
        n_over = (self.cap - self.sum_off) / self.b
        if n_over < n_fin:
            self.next_n, self.next_overflow = max(n_over, self.n), True
        else:
            self.next_n, self.next_overflow = n_fin, False
        self.next_t = self.t + self._time_between(self.n, self.next_n)

    def pop_finished(self) -> list[int]:
        out = []
        heap, running = self.heap, self.running
        while heap:
            fin, rid = heap[0]
            if rid not in running or running[rid][1] != fin:
                heapq.heappop(heap)
                continue
            if fin > self.n + _EPS:
                break
            heapq.heappop(heap)
            self.remove(rid)
            out.append(rid)
        return out


class RoundSimulator:
    """Runs rounds for one policy: lengths in, planner decisions applied, outcome out."""

    def __init__(self, prof: CostProfile, engines: int, prompt_len: int, sat_batch: int) -> None:
        self.prof = prof
        self.engines = engines
        self.prompt_len = prompt_len
        self.sat = sat_batch

    def run(
        self,
        planner: TailBatchingPlanner,
        prompts: list[int],
        lengths: list[list[int]],
        engines: int | None = None,
        join_engines: int = 0,
        join_at: float = 0.0,
        work: list[float] | None = None,
        release_base: int = 0,
        side: SideEngines | None = None,
    ) -> RoundOutcome:
        """Simulate the round ``planner`` has started. ``lengths[i][j]`` is the length of
        response j of ``prompts[i]``. Stops when the planner says the round is complete.

        ``join_engines`` more engines become ready ``join_at`` seconds into the round and take
        a share of the unfinished work (module doc); ``join_at <= 0``: they are there from the
        start (the round is spread over all engines). A round that completes first never
        sees them.

        ``work`` (length-aware dispatch): each prompt's predicted work (e.g. from a length
        prior); prompts then go, the most work first, each to the engine with the least
        predicted work so far, and queue on it in that order. None: prompt k goes to engine
        k mod engines in the planner's order (as the driver's count-balancing does).

        ``release_base`` > 0: the added engines (all but the first ``release_base``) are given
        back as soon as the unfinished requests fit on the first ones (module doc).

        ``side``: ``side.engines`` engines of ``side.prof`` after the round's own serve
        ``side.prompts`` alone, the own engines every other prompt (module doc)."""
        n_eng = self.engines if engines is None else engines
        if side is not None:
            if join_engines or release_base or work is not None:
                raise ValueError("side engines do not combine with joins, releases or"
                                 " length-aware dispatch")
            if side.engines < 1:
                raise ValueError(f"side.engines must be >= 1, got {side.engines}")
        if join_engines < 0:
            raise ValueError(f"join_engines must be >= 0, got {join_engines}")
        if release_base < 0:
            raise ValueError(f"release_base must be >= 0, got {release_base}")
        pending_join = join_engines
        if pending_join and join_at <= 0.0:
            n_eng, pending_join = n_eng + join_engines, 0
        engs = [_Engine(self.prof, self.sat) for _ in range(n_eng)]
        if side is not None:
            engs += [_Engine(side.prof, side.sat_batch) for _ in range(side.engines)]
        req_prompt: list[int] = []
        req_idx: list[int] = []
        req_len: list[int] = []
        req_eng: list[int] = []
        by_prompt: dict[int, list[int]] = {}
        order = list(range(len(prompts)))
        home = [k % n_eng for k in order]
        if side is not None:
            counts = [0, 0]  # prompts placed on the own engines, on the side's
            for k in order:
                on_side = prompts[k] in side.prompts
                pool, first = (side.engines, n_eng) if on_side else (n_eng, 0)
                home[k] = first + counts[on_side] % pool
                counts[on_side] += 1
        if work is not None:
            order.sort(key=lambda k: -work[k])
            assigned = [0.0] * n_eng
            for k in order:
                home[k] = min(range(n_eng), key=lambda i: (assigned[i], i))
                assigned[home[k]] += work[k]
        for k in order:
            p, lens = prompts[k], lengths[k]
            e = home[k]
            first, n = len(req_len), len(lens)
            rids = list(range(first, first + n))
            req_prompt.extend([p] * n)
            req_idx.extend(range(n))
            req_len.extend(lens)
            req_eng.extend([e] * n)
            engs[e].waiting.extend(rids)
            by_prompt[p] = rids
        req_gen = [0] * len(req_len)
        dead: set[int] = set()
        prof = self.prof
        plen = self.prompt_len

        def admit(eng: _Engine) -> None:
            w = eng.waiting
            limit = eng.prof.kv_capacity_tokens * (1.0 - eng.prof.kv_watermark)
            while w and eng.b < eng.prof.max_num_seqs:
                rid = w[0]
                if rid in dead:
                    w.popleft()
                    continue
                need = plen + req_gen[rid]
                if eng.b and eng.usage() + need > limit:
                    break
                w.popleft()
                eng.start(rid, plen, req_gen[rid], req_len[rid])
            eng.refresh()

        def abort(rid: int, now: float, touched: set[int]) -> None:
            if rid in dead:
                return
            dead.add(rid)
            eng = engs[req_eng[rid]]
            if rid in eng.running:
                eng.advance_time(now)
                eng.remove(rid)
                touched.add(req_eng[rid])

        def load(eng: _Engine) -> int:
            return eng.b + len(eng.waiting)

        def join(t: float) -> int:
            """Engines ready at ``t`` join and take their share; returns requests moved."""
            old = list(engs)
            for e in old:
                e.waiting = deque(r for r in e.waiting if r not in dead)
            new = [_Engine(prof, self.sat, t) for _ in range(pending_join)]
            engs.extend(new)
            quota = sum(load(e) for e in old) // len(engs)
            moved = 0
            donors: set[int] = set()
            for k, ne in enumerate(new, start=len(old)):
                for _ in range(quota):
                    di = max(range(len(old)), key=lambda i: load(old[i]))
                    donor = old[di]
                    if di not in donors:  # engines that give nothing are left as they are
                        donor.advance_time(t)
                        donors.add(di)
                    if donor.waiting:
                        rid = donor.waiting.pop()
                    elif donor.b:
                        rid = next(reversed(donor.running))
                        off = donor.remove(rid)
                        req_gen[rid] = int(off + donor.n) - plen
                    else:
                        break
                    req_eng[rid] = k
                    ne.waiting.append(rid)
                    moved += 1
            for i in sorted(donors):
                admit(old[i])
            for ne in new:
                admit(ne)
            return moved

        # releaseWhenFits: the load an engine began the round with (after a join, the share
        # each then held), by which the unfinished requests must fit on the own engines
        start_load = -(-len(req_len) // len(engs))
        gone_busy = gone_span = 0.0  # the given-back engines' share of the round
        released_at: float | None = None
        moved_back = 0

        def release(t: float) -> int:
            """The added engines' unfinished requests go to the own ones; they leave."""
            nonlocal gone_busy, gone_span
            own, extras = engs[:release_base], engs[release_base:]
            for e in own:
                e.advance_time(t)
                e.waiting = deque(r for r in e.waiting if r not in dead)
            n = 0
            for x in extras:
                x.advance_time(t)
                taken = [r for r in x.waiting if r not in dead]
                for rid in list(x.running):
                    off = x.remove(rid)
                    # whole tokens generated (the counter lands a hair under an integer step)
                    req_gen[rid] = int(off + x.n + 1e-6) - plen
                    taken.append(rid)
                for rid in taken:
                    di = min(range(release_base), key=lambda i: (load(own[i]), i))
                    req_eng[rid] = di
                    own[di].waiting.append(rid)
                    n += 1
                gone_busy += x.busy
                gone_span += t - x.t0
            del engs[release_base:]
            for e in own:
                admit(e)
            return n

        for eng in engs:
            admit(eng)
        kept: list[int] = []
        kept_of: dict[int, list[int]] = {}  # prompt -> its kept lengths
        group_done: list[tuple[float, int, int]] = []
        rp = planner.current_round
        per_group = rp.keep_per_prompt if rp is not None else 0
        preemptions = 0
        moved = joined = 0
        now = 0.0
        complete = False
        while not complete:
            eng = min(engs, key=lambda x: x.next_t)
            if pending_join and join_at <= eng.next_t:
                now = join_at
                moved = join(join_at)
                joined, pending_join = pending_join, 0
                start_load = -(-(len(req_len) - len(dead)) // len(engs))
                continue
            if eng.next_t == math.inf:
                raise RuntimeError("simulated round stalled before the planner saw it complete")
            now = eng.next_t
            ei = engs.index(eng)
            eng.advance_counter(eng.next_n)
            touched = {ei}
            if eng.next_overflow:
                target = eng.prof.kv_capacity_tokens * (1.0 - _PREEMPT_HEADROOM)
                while eng.b > 1 and eng.usage() > target:
                    victim = next(reversed(eng.running))
                    off = eng.remove(victim)
                    req_gen[victim] = int(off + eng.n) - plen
                    eng.waiting.appendleft(victim)
                    preemptions += 1
                # A single sequence alone may not fit: let it run past the bound.
                if eng.b == 1 and eng.usage() > target:
                    eng.cap = math.inf
            else:
                for rid in eng.pop_finished():
                    dead.add(rid)
                    d = planner.on_response_finished(req_prompt[rid], req_idx[rid])
                    if d.keep:
                        kept.append(req_len[rid])
                        mine = kept_of.setdefault(req_prompt[rid], [])
                        mine.append(req_len[rid])
                        if len(mine) == per_group:
                            group_done.append((now, sum(mine), len(mine)))
                    for p, j in d.abort_responses:
                        abort(by_prompt[p][j], now, touched)
                    for p in d.abort_prompts:
                        for r in by_prompt[p]:
                            abort(r, now, touched)
                    if d.round_complete:
                        complete = True
                        break
            if complete:
                break
            for i in touched:
                admit(engs[i])
            if (release_base and released_at is None and not pending_join
                    and len(engs) > release_base
                    and len(req_len) - len(dead) <= start_load * release_base):
                released_at = now
                moved_back = release(now)
        busy, span = gone_busy, gone_span
        for eng in engs:
            eng.advance_time(now)
            busy += eng.busy
            span += now - eng.t0
        aborted = len(req_len) - len(kept)
        frac = min(1.0, busy / span) if span > 0 else 1.0
        return RoundOutcome(now, frac, kept, aborted, preemptions, moved, joined,
                            tuple(group_done), released_at, moved_back)
