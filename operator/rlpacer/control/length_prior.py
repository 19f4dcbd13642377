"""A per-prompt response-length prior, learned online from each prompt's earlier groups.

Pure (no I/O): the driver (or the simulator) gives it every trained group's response lengths
by prompt id; it never reads the prompt's text. The model, in log space (response lengths are
close to log-normal, and the recorded traces' spread is multiplicative)::

    log L_pj = mu_p + e_pj,   e_pj ~ N(0, s_w^2)       within a prompt's group
    mu_p ~ N(m, t^2)                                     between prompts (the population)

``s_w^2`` is the pooled within-group variance, ``m`` and ``t^2`` the mean and variance of the
groups' mean log lengths (less the part of it that is within-group noise), all from every group
seen so far. A prompt with ``n`` observed responses (over its earlier epochs) has the posterior
``mu_p | data ~ N(mu_hat, v)``, ``1/v = 1/t^2 + n/s_w^2``, ``mu_hat = v (m/t^2 + sum log L /
s_w^2)``: an unseen prompt is predicted as the population, a prompt seen often as itself. A
response's predictive distribution is ``N(mu_hat, v + s_w^2)`` in log space; its quantiles are
:meth:`LengthPrior.quantile`.

**Forgetting** (``half_life``, optional): lengths drift as the policy learns (a model taught
to stop rambling answers in a tenth of the tokens a few steps later), and a prior that weighs
every epoch alike keeps predicting the lengths of the policy that was. With a half-life of
``H`` groups the population level drifts, ``log L_pj = m(t) + b_p + e_pj``, and each
observed group's evidence weighs ``2^(-k/H)`` once ``k`` more groups have been observed: the
population's sums (the groups' mean log lengths, their squares, the within-group sums of
squares and their degrees of freedom) are discounted by ``2^(-1/H)`` at each group, so ``m``
follows the recent groups. A prompt's own responses are kept as their offsets from the
population level when they were observed (``b_p``'s evidence, so a prompt that ran longer
than most still does after the whole population has shortened) and discounted by the groups
observed since (a prompt seen one epoch ago, with ``N`` prompts an epoch, counts
``2^(-N/H)`` of a fresh one: a prompt whose own lengths changed is followed too). Unset,
every group weighs the same and a prompt's responses are kept as they are (the population is
stationary). A prompt counts as seen (``Prediction.seen``) by its responses, whatever their
weight.

**Censoring.** A short round of tail batching aborts each kept prompt's slowest response(s);
those have no length, only a lower bound (the group's longest finished one).
:meth:`LengthPrior.observe` takes their count and imputes each at its mean under the prompt's
predictive distribution given that bound (a truncated normal's mean, at least the bound); a
long round's groups and plain rounds' are uncensored.

**Calibration** (:meth:`LengthPrior.calibration`): before each group updates the prior, every
finished length of it is checked against the prediction made without it: the fraction at or
below the predicted 10th, 50th and 90th percentiles (a calibrated prior gives 0.1, 0.5, 0.9),
kept apart for prompts seen before and unseen ones (an aborted response counts as above a
predicted quantile at or below its group's longest finished length, and is left out against a
higher one: censored lengths would otherwise make every prediction look too long); and the
*level skill*: 1 - (squared error
of the predicted level against the group's realised mean log length) / (the realised means'
variance), over prompts seen before (0: no better than the population, 1: perfect). On the
recorded traces most of the length variance is inside a group (83-87%), which bounds what any
per-prompt prior can know.

**Straggler risk** (:meth:`LengthPrior.straggler_risk`): the probability that a round of
given prompts straggles (kept max over kept median above tau) at each candidate G, by Monte
Carlo from the predictive distributions, the round's race modelled (each prompt launches G +
extra responses, keeps its first G to finish, and the first ``target`` groups to complete are
kept): SAGC's context (rlpacer.control.sagc). Common random numbers across the candidates.

The prior is a few numbers per prompt (:meth:`state_dict` is JSON), saved with the planner in
the trainer's checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

from rlpacer.control._validate import require_float, require_int
from rlpacer.control.errors import StateError

_STATE_VERSION = 2  # 2: forgetting (half_life, the clock, each prompt's weight and stamp)
QUANTILES = (0.1, 0.5, 0.9)
_STD = NormalDist()
#: Monte Carlo draws of :meth:`LengthPrior.straggler_risk` (its standard error at p = 0.2 is
#: 0.035; SAGC uses it only to split rounds at their recent mean).
RISK_SAMPLES = 128


@dataclass(frozen=True)
class Prediction:
    """A prompt's predicted response length, in log tokens."""

    level: float
    """Posterior mean of the prompt's mean log length (mu_hat)."""
    level_var: float
    """Posterior variance of that level (v)."""
    within_var: float
    """Pooled within-group variance (s_w^2)."""
    seen: int
    """Responses of this prompt observed so far."""

    def quantile(self, q: float) -> float:
        """The q-quantile of one response's length, tokens."""
        if not 0.0 < q < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {q}")
        z = _STD.inv_cdf(q)
        return math.exp(self.level + z * math.sqrt(self.level_var + self.within_var))


class LengthPrior:
    """Online per-prompt length prior; see the module docstring."""

    def __init__(self, num_prompts: int, half_life: float | None = None) -> None:
        self._n = require_int("num_prompts", num_prompts, minimum=1)
        self._half_life: float | None = None
        self._decay = 1.0
        self.half_life = half_life
        self._clock = 0  # groups observed
        # per prompt: responses seen, their weight and weighted sum of log lengths at the
        # clock of its last group (its stamp); without forgetting the weight is the count
        self._count: dict[int, int] = {}
        self._weight: dict[int, float] = {}
        self._sum: dict[int, float] = {}
        self._stamp: dict[int, int] = {}
        # population (weighted): groups, sum and sum of squares of group means; pooled
        # within-group sum of squared deviations and its degrees of freedom
        self._groups = 0.0
        self._gsum = 0.0
        self._gsq = 0.0
        self._gsize = 0.0  # sum over groups of 1/size (the within-noise share of a mean)
        self._wss = 0.0
        self._wdf = 0.0
        # calibration
        # per kind, per quantile: [responses at or below the predicted quantile, responses
        # judged]; a censored response is judged only where its lower bound settles it
        self._cover = {k: [[0, 0] for _ in QUANTILES] for k in ("seen", "unseen")}
        self._responses = {"seen": 0, "unseen": 0}
        self._sse = 0.0
        self._skill_n = 0
        self._skill_sum = 0.0
        self._skill_sq = 0.0

    # --- the model --------------------------------------------------------------------------
    @property
    def num_prompts(self) -> int:
        return self._n

    @property
    def groups(self) -> int:
        """Groups observed so far."""
        return self._clock

    @property
    def half_life(self) -> float | None:
        """Groups after which a group's evidence weighs half (None: no forgetting)."""
        return self._half_life

    @half_life.setter
    def half_life(self, value: float | None) -> None:
        """Set or change the half-life. Turning forgetting on or off re-expresses each prompt's
        evidence (offsets from the population level now, or log lengths) as of now, so every
        prediction stays what it was; changing it re-weighs the evidence not yet discounted
        by its age at the new rate."""
        if value is not None:
            value = require_float("half_life", value, low=1.0)
        was = self._half_life
        if (was is None) != (value is None) and getattr(self, "_clock", 0) > 0:
            m = self._population()[0]
            sign = -1.0 if value is not None else 1.0  # to offsets, or back to log lengths
            for p in self._weight:
                w, total = self._own(p)
                self._weight[p], self._sum[p] = w, total + sign * w * m
                self._stamp[p] = self._clock
        self._half_life = value
        self._decay = 1.0 if value is None else 2.0 ** (-1.0 / value)

    def _own(self, prompt: int) -> tuple[float, float]:
        """The prompt's (weight, weighted sum): of log lengths, or with forgetting of their
        offsets from the population level when observed; discounted to now."""
        w = self._weight.get(prompt, 0.0)
        if not w:
            return 0.0, 0.0
        f = self._decay ** (self._clock - self._stamp[prompt]) if self._decay < 1.0 else 1.0
        return w * f, self._sum[prompt] * f

    def _population(self) -> tuple[float, float, float]:
        """(m, t^2, s_w^2); before any data a wide prior around e^5 ~ 150 tokens."""
        sw2 = max(self._wss / self._wdf, 1e-4) if self._wdf > 0 else 1.0
        if self._clock == 0:
            return 5.0, 4.0, sw2
        m = self._gsum / self._groups
        var_means = max(0.0, self._gsq / self._groups - m * m)
        # a group mean's variance is t^2 + s_w^2 / size: take the noise out (at least a floor)
        t2 = max(var_means - sw2 * self._gsize / self._groups, 0.05 * var_means, 1e-4)
        return m, t2, sw2

    def predict(self, prompt: int) -> Prediction:
        """The prompt's predicted length (the population's for a prompt never seen)."""
        m, t2, sw2 = self._population()
        n, total = self._own(prompt)
        if self._half_life is not None:  # offsets from the level when observed: to today's
            total += n * m
        prec = 1.0 / t2 + n / sw2
        v = 1.0 / prec
        level = v * (m / t2 + total / sw2)
        return Prediction(level, v, sw2, self._count.get(prompt, 0))

    def quantile(self, prompt: int, q: float) -> float:
        """The q-quantile of one response's length for ``prompt``, tokens."""
        return self.predict(prompt).quantile(q)

    def level_rank(self, prompt: int) -> float:
        """Where the prompt's predicted level sits in the population, as a normal quantile
        (0.5: a typical prompt; 0.9: longer than 90% of prompts)."""
        m, t2, _ = self._population()
        p = self.predict(prompt)
        return _STD.cdf((p.level - m) / math.sqrt(t2))

    def straggler_risk(
        self, prompts: Sequence[int], sizes: Sequence[int], tau: float, *, extra: int = 0,
        target: int | None = None, cap: float | None = None, samples: int = RISK_SAMPLES,
        seed: int = 0,
    ) -> dict[int, float]:
        """``{G: P(kept max > tau * kept median)}`` of a round launching ``prompts``, each with
        G + ``extra`` responses and keeping its first G to finish, and keeping the first
        ``target`` groups to complete (all when None); lengths capped at ``cap`` tokens (the
        response limit). Empty before the prior has seen a group (nothing to predict from).
        Deterministic in ``seed``."""
        if self._clock == 0 or not prompts or not sizes:
            return {}
        require_float("tau", tau, low=1, low_open=True)
        require_int("extra", extra, minimum=0)
        require_int("samples", samples, minimum=1)
        n = len(prompts)
        keep = n if target is None else min(require_int("target", target, minimum=1), n)
        preds = [self.predict(p) for p in prompts]
        level = np.array([p.level for p in preds])
        level_sd = np.sqrt(np.array([p.level_var for p in preds]))
        within_sd = math.sqrt(preds[0].within_var)
        rng = np.random.Generator(np.random.PCG64(seed))
        widest = max(sizes) + extra
        mu = level + level_sd * rng.standard_normal((samples, n))
        lengths = np.exp(mu[:, :, None] + within_sd * rng.standard_normal((samples, n, widest)))
        if cap is not None:
            np.minimum(lengths, cap, out=lengths)
        out: dict[int, float] = {}
        for g in sorted(set(int(x) for x in sizes)):
            launched = lengths[:, :, : g + extra]
            if extra > 0 or keep < n:
                first = np.sort(launched, axis=2)[:, :, :g]  # each group's first g to finish
                done_at = first[:, :, -1]  # a group completes with its g-th response
                order = np.argsort(done_at, axis=1, kind="stable")[:, :keep]
                kept = np.take_along_axis(first, order[:, :, None], axis=1)
            else:
                kept = launched
            flat = kept.reshape(samples, -1)
            out[g] = float(np.mean(flat.max(axis=1) > tau * np.median(flat, axis=1)))
        return out

    def observe(self, prompt: int, lengths: Sequence[int], censored: int = 0) -> None:
        """A trained group of ``prompt``: its finished lengths (tokens) and how many of its
        responses were aborted unfinished (imputed at the longest finished; module doc)."""
        if not 0 <= prompt < self._n:
            raise ValueError(f"prompt {prompt} outside [0, {self._n})")
        require_int("censored", censored, minimum=0)
        ls = [int(x) for x in lengths]
        if any(x < 1 for x in ls):
            raise ValueError(f"lengths must be >= 1 token, got {ls}")
        if not ls:
            return
        self._calibrate(prompt, ls, censored)
        logs = [math.log(x) for x in ls] + [self._impute(prompt, max(ls))] * censored
        k = len(logs)
        mean = sum(logs) / k
        w, total = self._own(prompt)
        # with forgetting a prompt keeps its offsets from the population level of now
        anchor = self._population()[0] * k if self._half_life is not None else 0.0
        self._clock += 1
        d = self._decay  # the population's evidence ages one group
        self._count[prompt] = self._count.get(prompt, 0) + k
        self._weight[prompt] = w * self._decay + k
        self._sum[prompt] = total * self._decay + sum(logs) - anchor
        self._stamp[prompt] = self._clock
        self._groups = self._groups * d + 1.0
        self._gsum = self._gsum * d + mean
        self._gsq = self._gsq * d + mean * mean
        self._gsize = self._gsize * d + 1.0 / k
        self._wss *= d
        self._wdf *= d
        if k > 1:
            self._wss += sum((x - mean) ** 2 for x in logs)
            self._wdf += k - 1

    def _impute(self, prompt: int, longest: int) -> float:
        """A censored response's log length: its mean under the prompt's predictive
        distribution given that it ran past ``longest`` (a truncated normal's mean)."""
        a = math.log(longest)
        if self._clock == 0:
            return a
        pred = self.predict(prompt)
        sd = math.sqrt(pred.level_var + pred.within_var)
        alpha = (a - pred.level) / sd
        tail = 1.0 - _STD.cdf(alpha)  # P(Y > a)
        if tail < 1e-12:
            return a
        dens = _STD.pdf(alpha)
        return max(a, pred.level + sd * dens / tail)

    # --- calibration ------------------------------------------------------------------------
    def _calibrate(self, prompt: int, lengths: list[int], censored: int = 0) -> None:
        if self._clock == 0:
            return  # no prediction yet
        pred = self.predict(prompt)
        kind = "seen" if pred.seen else "unseen"
        row = self._cover[kind]
        qs = [pred.quantile(q) for q in QUANTILES]
        longest = max(lengths)
        for i, qv in enumerate(qs):
            for x in lengths:
                row[i][0] += x <= qv
                row[i][1] += 1
            # an aborted response ran past the group's longest finished one: above any
            # predicted quantile at or below that; unknown against a higher one
            if qv <= longest:
                row[i][1] += censored
        self._responses[kind] += len(lengths) + censored
        if pred.seen:
            mean = sum(math.log(x) for x in lengths) / len(lengths)
            self._sse += (mean - pred.level) ** 2
            self._skill_n += 1
            self._skill_sum += mean
            self._skill_sq += mean * mean

    def calibration(self) -> dict[str, Any]:
        """Predicted against realised quantiles (module doc), as JSON."""
        out: dict[str, Any] = {"groups": self._clock, "half_life": self._half_life}
        for k, rows in self._cover.items():
            out[k] = {"responses": self._responses[k],
                      **{f"below_p{int(q * 100)}": (b / n if n else None)
                         for q, (b, n) in zip(QUANTILES, rows, strict=True)}}
        sst = self._skill_sq - self._skill_sum ** 2 / self._skill_n if self._skill_n else 0.0
        out["level_skill"] = (1.0 - self._sse / sst) if sst > 0 else None
        out["level_skill_groups"] = self._skill_n
        m, t2, sw2 = self._population()
        out["population"] = {"level": m, "between_var": t2, "within_var": sw2,
                             "within_share": sw2 / (sw2 + t2)}
        return out

    # --- persistence ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON. Without forgetting (every weight its count) in the form of version 1, which
        a trainer from before forgetting restores too; with it, version 2."""
        state: dict[str, Any] = {
            "kind": "length_prior", "version": _STATE_VERSION, "num_prompts": self._n,
            "half_life": self._half_life, "clock": self._clock,
            "count": {str(k): v for k, v in self._count.items()},
            "weight": {str(k): v for k, v in self._weight.items()},
            "sum": {str(k): v for k, v in self._sum.items()},
            "stamp": {str(k): v for k, v in self._stamp.items()},
            "population": [self._groups, self._gsum, self._gsq, self._gsize, self._wss,
                           self._wdf],
            "calibration": {"cover": self._cover, "responses": self._responses,
                            "skill": [self._sse, self._skill_n,
                                      self._skill_sum, self._skill_sq]},
        }
        if self._half_life is None and self._groups == self._clock and all(
                self._weight[k] == n for k, n in self._count.items()):
            for key in ("half_life", "clock", "weight", "stamp"):
                del state[key]
            state["version"] = 1
            state["population"][0] = self._clock
            state["population"][5] = int(self._wdf)
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> LengthPrior:
        if not isinstance(state, dict) or state.get("kind") != "length_prior":
            raise StateError("not a length-prior state")
        version = state.get("version")
        if version not in (1, _STATE_VERSION):
            raise StateError(f"unsupported length-prior state version {version!r}")
        try:
            p = cls(int(state["num_prompts"]), state.get("half_life"))
            p._count = {int(k): int(v) for k, v in state["count"].items()}
            p._sum = {int(k): float(v) for k, v in state["sum"].items()}
            g, gs, gq, gz, w, wd = state["population"]
            p._groups, p._gsum, p._gsq, p._gsize = float(g), float(gs), float(gq), float(gz)
            p._wss, p._wdf = float(w), float(wd)
            if version == 1:  # written before forgetting: every group weighed the same
                p._clock = int(g)
                p._weight = {k: float(v) for k, v in p._count.items()}
                p._stamp = dict.fromkeys(p._count, p._clock)
            else:
                p._clock = int(state["clock"])
                p._weight = {int(k): float(v) for k, v in state["weight"].items()}
                p._stamp = {int(k): int(v) for k, v in state["stamp"].items()}
            cal = state["calibration"]
            p._cover = {k: [[int(b), int(n)] for b, n in cal["cover"][k]]
                        for k in ("seen", "unseen")}
            p._responses = {k: int(cal["responses"][k]) for k in ("seen", "unseen")}
            p._sse, p._skill_n, p._skill_sum, p._skill_sq = (
                float(cal["skill"][0]), int(cal["skill"][1]), float(cal["skill"][2]),
                float(cal["skill"][3]))
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"cannot restore LengthPrior: {exc!r}") from exc
        if any(not 0 <= k < p._n for k in p._count):
            raise StateError("length prior holds unknown prompt ids")
        if not set(p._count) == set(p._weight) == set(p._sum) == set(p._stamp):
            raise StateError("length prior's per-prompt tables disagree")
        require_float("population groups", float(p._groups), low=0.0)
        return p
