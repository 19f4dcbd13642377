"""SAGC: straggler-aware group-size control (ALGORITHMS.md section 1; seed 000).

Each step the controller picks the GRPO group size G from a sorted candidate set, maximising
the long-run mean of ``u(G) = log2(G)`` subject to a long-run straggler rate of at most
``delta``. A step is a straggler when ``max_len / median_len > tau`` over its responses.

Shapes and updates (one step = one ``decide()`` then one ``observe()``)::

    belief      p(G) ~ Beta(alpha_G, beta_G)            one per candidate G
    chosen arm  alpha_G <- gamma * alpha_G + S_t        S_t in {0, 1}, gamma = forgetting
                beta_G  <- gamma * beta_G + (1 - S_t)
    dual        lambda  <- clip(lambda + eta * (S_t - delta), 0, lambda_max)
    decide      argmax_{G in N_r(G_prev)} log2(G) - lambda * p~_G,   p~_G ~ Beta(alpha_G, beta_G)

where ``N_r(G_prev)`` is the candidates within ``radius`` positions of the current G.

Decisions taken here (ALGORITHMS.md leaves them open):

* **Unchosen arms do not decay by default** (``decay_unchosen=False``): only the chosen
  arm's belief is discounted by ``gamma``. With ``decay_unchosen=True`` every other arm
  decays toward the prior, ``alpha_H <- gamma * alpha_H + (1 - gamma) * alpha0`` (beta
  alike): discounted Thompson sampling for drifting workloads (Raj & Kalyani, 2017), which
  re-tests sizes not used for a while. We measured both in ``rlpacer bench`` (default
  scenario, 200 steps, seeds 0-3, tau 16 / 20, delta 0.2): decay overshot the SLO by 0.035 to
  0.10 (long-run straggler rate minus delta) against 0.015 to 0.045 without, and trained
  slower (mean wall clock 5.05 h vs 4.69 h at tau 16). A decayed arm drifts back to the
  prior and Thompson sampling keeps re-visiting it; under the local-search radius that costs
  straggler steps at the large sizes, and lengths drift too slowly for the re-tests to pay.
  Keep ``forgetting`` for drift; turn decay on for workloads that change abruptly.
* **The prior is centred on delta**: ``Beta(s * m, s * (1 - m))`` with ``m = prior_mean``
  (default ``delta``) and ``s = prior_strength`` (default 2). A size never tried is believed
  to sit exactly on the SLO: neither pessimistic (Beta(1, 1) has mean 0.5, which makes an
  untried smaller size look *worse* than a known G=16 at p=0.4, so the controller stays
  stuck at the large size however high lambda climbs) nor reckless.
* Pseudo-counts are floored at ``1e-6`` so a long run of identical outcomes under forgetting
  cannot underflow to an improper Beta(0, .) (the floor is far below any count that matters).
* Ties in the Thompson score go to the smaller G (the cheaper, safer choice).
* ``decide()`` again before ``observe()`` returns the same pending G and draws nothing.
* The first decision (no step observed yet) is ``initial`` and draws nothing: the spec
  documents ``initial`` as the first group size, and a draw before any evidence would only
  move G by the prior's noise.
* **Context** (``decide(context=...)``, optional): the next round's predicted straggler
  probability per candidate G, from a per-prompt length prior
  (rlpacer.control.length_prior.LengthPrior.straggler_risk). Each candidate keeps two more
  Beta posteriors, for rounds predicted riskier than the mean of that candidate's last
  ``CONTEXT_HISTORY`` contexts and for the rest (a relative split, so a prior whose
  probabilities are off by a constant factor still splits; the mean, not the median, so a
  context of few distinct values, 0 and 1 say, splits too), updated with the same
  forgetting. Once a candidate has ``CONTEXT_MIN`` contexts its Thompson draw comes from the
  posterior its context names; before that, and for a candidate the context leaves out, from
  the pooled one. The pooled posteriors are updated on every step as without context, and
  are what ``posterior()`` and the SLO verdict read: a controller never given a context
  decides exactly as before (same draws), and a state written before has no context
  posteriors and restores with fresh ones.
* **Objective per second** (``objective="second"``, optional; the default ``"step"`` is the
  paper's): what G buys is weighed against what its step costs. The controller keeps each
  size's step seconds (rollout, reward, training and sync, as the step report gives them),
  forgotten like the posterior, and decides
  ``argmax log2(G) * c(G_prev) / c(G) - lambda * p~_G``: log2(G) per second, in units of
  the current size's step so that lambda keeps its scale. Where steps report their response
  tokens, ``c`` comes from them: ``k * G ** e_g * (tokens / G) ** e_len`` (the elasticities
  in ``ELASTICITY_BOUNDS``) fitted in logs to the last ``TOKEN_HISTORY`` steps of every size,
  weighted ``forgetting ** age``, at the last step's tokens per unit of G. So a size
  measured while responses ran long is priced at today's lengths (priced per size, such a
  size stays dear until it runs again, and SAGC drifted to larger sizes on the ramble task
  for it), and the choice rests on ``e_g``: ``c(G_prev) / c(G) = (G_prev / G) ** e_g``. G and
  the lengths apart, not tokens alone: a step's seconds grow about in proportion to G but
  much less than in proportion to its responses' lengths (a batch decodes its responses side
  by side), and while the model stops rambling the lengths fall; fitted on tokens alone
  (``k * tokens ** beta``, the first version) the falling lengths made tokens look nearly
  free (beta about 0.6 on the ramble task's steps) and G=8 as cheap per log2(G) as G=4, where
  G=4 was better (docs/benchmarks.md, "SAGC per second"). Without tokens (an older trainer) a
  size is priced from its own steps, and a size not measured yet from a line ``a + b * G``
  fitted to the measured sizes. Either way, while one size has run, seconds are taken in
  proportion to G, so a smaller size looks cheaper than it will be and is tried. Before any
  step is measured the objective is per step. Seconds and tokens are kept, and written to
  the state (``step_seconds``, ``step_tokens``) and the config's ``objective``, only under
  this objective, so a per-step state is what older releases wrote and restore. Why: where
  what a step teaches depends little on G (a task RL fixes in a few updates whatever the
  group), the largest G that keeps the SLO is the
  slowest way to the same model; per second, SAGC picks the size whose log2(G) costs least,
  and the SLO still bounds it. A state written before has no seconds and restores with none
  measured.
* The Thompson draws use one numpy ``Generator`` (PCG64); its full bit-generator state is in
  ``state_dict()``, so ``from_state_dict(state_dict())`` continues bit for bit.

:class:`FixedController` has the same interface with a constant G (baselines, ``mode:
Fixed``); it still tracks a Beta posterior of its one size so p(G) is reported either way.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

import numpy as np

from rlpacer.control._validate import require_bool, require_float, require_int
from rlpacer.control.errors import ConfigError, ObservationError, StateError

__all__ = [
    "FixedConfig",
    "FixedController",
    "GroupControlMode",
    "GroupController",
    "SAGCConfig",
    "SAGCController",
    "controller_from_state_dict",
    "is_straggler",
    "make_controller",
]

_MIN_PSEUDO_COUNT = 1e-6
_STATE_VERSION = 1
#: Contexts remembered per candidate for the split at their mean (module docstring).
CONTEXT_HISTORY = 32
#: Contexts a candidate needs before its draws come from the context's posterior.
CONTEXT_MIN = 8
#: ``SAGCConfig.objective``'s values: log2(G) per step, or per second of a step (docstring)
OBJECTIVES = ("step", "second")
#: Steps whose (G, tokens, seconds) the objective per second prices a step from.
TOKEN_HISTORY = 64


def is_straggler(max_len: float, median_len: float, tau: float) -> bool:
    """The straggler event of a step: ``max_len / median_len > tau``."""
    return max_len > tau * median_len


def _fit_cost_line(g: list[float], c: list[float], w: list[float]) -> tuple[float, float]:
    """Weighted least squares of ``c = a + b * g`` with a, b >= 0 (one distinct g: through
    the origin)."""
    sw = math.fsum(w)
    mg = math.fsum(wi * gi for wi, gi in zip(w, g, strict=True)) / sw
    mc = math.fsum(wi * ci for wi, ci in zip(w, c, strict=True)) / sw
    sgg = math.fsum(wi * (gi - mg) ** 2 for wi, gi in zip(w, g, strict=True))
    if sgg > 0:
        b = math.fsum(wi * (gi - mg) * (ci - mc) for wi, gi, ci in zip(w, g, c, strict=True)) / sgg
        a = mc - b * mg
        if b >= 0 and a >= 0:
            return a, b
        if b < 0:  # a larger size measured no dearer: a flat price
            return mc, 0.0
    # through the origin
    b = (math.fsum(wi * gi * ci for wi, gi, ci in zip(w, g, c, strict=True))
         / math.fsum(wi * gi * gi for wi, gi in zip(w, g, strict=True)))
    return 0.0, b


#: Bounds of the fitted elasticities of a step's seconds in G and in its tokens per response.
ELASTICITY_BOUNDS = (0.0, 2.0)


def _clamp(v: float) -> float:
    return min(max(v, ELASTICITY_BOUNDS[0]), ELASTICITY_BOUNDS[1])


def _fit_cost_surface(lg: list[float], ll: list[float], ls: list[float],
                      w: list[float]) -> tuple[float, float, float]:
    """Weighted least squares of ``ls = log_k + a * lg + b * ll`` (logs of G, of tokens per
    unit of G, and of seconds): ``(a, b, log_k)``, the elasticities within
    ``ELASTICITY_BOUNDS``. Where G does not vary, ``a`` is 1 (seconds in proportion to G);
    where the lengths do not vary (or move with G), ``b`` is 0 and ``a`` is fitted alone."""
    sw = math.fsum(w)

    def centred(v: list[float]) -> list[float]:
        m = math.fsum(wi * x for wi, x in zip(w, v, strict=True)) / sw
        return [x - m for x in v]

    g, ln, y = centred(lg), centred(ll), centred(ls)

    def dot(u: list[float], v: list[float]) -> float:
        return math.fsum(wi * ui * vi for wi, ui, vi in zip(w, u, v, strict=True))

    sgg, sll, sgl, sgy, sly = dot(g, g), dot(ln, ln), dot(g, ln), dot(g, y), dot(ln, y)
    if sgg <= 1e-12:  # one size: seconds in proportion to G, lengths fitted alone
        a = 1.0
        b = _clamp(sly / sll) if sll > 1e-12 else 0.0
    else:
        det = sgg * sll - sgl * sgl
        if sll <= 1e-12 or det <= 1e-9 * sgg * sll:
            a, b = _clamp(sgy / sgg), 0.0
        else:
            a = _clamp((sll * sgy - sgl * sly) / det)
            b = _clamp((sly - a * sgl) / sll)  # given the (clamped) a
    log_k = math.fsum(wi * (yi - a * gi - b * li)
                      for wi, yi, gi, li in zip(w, ls, lg, ll, strict=True)) / sw
    return a, b, log_k


def _check_seconds(seconds: float | None, name: str = "seconds") -> float:
    """A step's measured seconds (or tokens), 0.0 when not measured (None or 0)."""
    if seconds is None:
        return 0.0
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ObservationError(f"{name} must be a number, got {seconds!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ObservationError(f"{name} must be finite and >= 0, got {seconds!r}")
    return float(seconds)


def _check_lengths(max_len: float, median_len: float) -> tuple[float, float]:
    """Validate a step's length summary; raise :class:`ObservationError` when impossible."""
    for name, value in (("max_len", max_len), ("median_len", median_len)):
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
            raise ObservationError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(float(value)) or float(value) <= 0:
            raise ObservationError(f"{name} must be a positive finite length, got {value!r}")
    if float(max_len) < float(median_len):
        raise ObservationError(
            f"max_len ({max_len}) < median_len ({median_len}): the longest response cannot be"
            " shorter than the median"
        )
    return float(max_len), float(median_len)


@dataclass(frozen=True)
class SAGCConfig:
    """Configuration of :class:`SAGCController`. Invalid values raise :class:`ConfigError`
    naming the field."""

    candidates: tuple[int, ...] = (4, 8, 16)
    """Allowed group sizes, strictly increasing positive integers."""
    delta: float = 0.2
    """Straggler SLO: target long-run fraction of straggler steps, in (0, 1)."""
    tau: float = 4.0
    """A step with ``max_len / median_len > tau`` is a straggler (> 1). Put it near the
    workload's typical ratio, or the constraint never binds (ALGORITHMS.md)."""
    forgetting: float = 0.95
    """Posterior forgetting factor gamma in (0, 1]; 1 = no forgetting."""
    dual_step: float = 0.05
    """Dual ascent step size eta (>= 0)."""
    lambda_max: float = 10.0
    """Upper bound of the multiplier lambda (> 0)."""
    radius: int = 1
    """Local search: G moves at most this many candidate positions per step (>= 0)."""
    initial: int = 8
    """First group size; must be a candidate."""
    seed: int = 0
    """Seed of the Thompson-sampling generator (>= 0)."""
    prior_mean: float | None = None
    """Prior mean of every p(G), in (0, 1); None = ``delta`` (see the module docstring)."""
    prior_strength: float = 2.0
    """Prior pseudo-count alpha0 + beta0 (> 0): how many steps of evidence it is worth."""
    decay_unchosen: bool = False
    """Unchosen arms also decay toward the prior each step (see the module docstring)."""
    objective: str = "step"
    """What G maximises: ``"step"``, log2(G) per step (the paper's), or ``"second"``,
    log2(G) per second of a step's measured wall clock (see the module docstring)."""

    def __post_init__(self) -> None:
        cands = self.candidates
        if isinstance(cands, str | bytes) or not hasattr(cands, "__iter__"):
            raise ConfigError("candidates", f"must be a sequence of integers, got {cands!r}")
        cands = tuple(cands)
        if not cands:
            raise ConfigError("candidates", "must not be empty; e.g. (4, 8, 16)")
        for i, g in enumerate(cands):
            require_int(f"candidates[{i}]", g, minimum=1)
        if len(set(cands)) != len(cands):
            raise ConfigError("candidates", f"must not contain duplicates, got {cands}")
        if list(cands) != sorted(cands):
            raise ConfigError("candidates", f"must be sorted ascending, got {cands}")
        object.__setattr__(self, "candidates", cands)
        require_float("delta", self.delta, low=0, high=1, low_open=True, high_open=True)
        require_float(
            "tau", self.tau, low=1, low_open=True,
            hint="a ratio max/median; pick it near the workload's typical ratio",
        )
        require_float("forgetting", self.forgetting, low=0, high=1, low_open=True)
        require_float("dual_step", self.dual_step, low=0)
        require_float("lambda_max", self.lambda_max, low=0, low_open=True)
        require_int("radius", self.radius, minimum=0)
        require_int("initial", self.initial, minimum=1)
        if self.initial not in cands:
            raise ConfigError("initial", f"must be one of candidates {cands}, got {self.initial}")
        require_int("seed", self.seed, minimum=0)
        if self.prior_mean is not None:
            require_float(
                "prior_mean", self.prior_mean, low=0, high=1, low_open=True, high_open=True
            )
        require_float("prior_strength", self.prior_strength, low=0, low_open=True)
        require_bool("decay_unchosen", self.decay_unchosen)
        if self.objective not in OBJECTIVES:
            raise ConfigError("objective", f"must be one of {', '.join(map(repr, OBJECTIVES))},"
                              f" got {self.objective!r}")

    @property
    def alpha0(self) -> float:
        """Prior pseudo-count of straggler steps."""
        mean = self.delta if self.prior_mean is None else self.prior_mean
        return self.prior_strength * mean

    @property
    def beta0(self) -> float:
        """Prior pseudo-count of normal steps."""
        mean = self.delta if self.prior_mean is None else self.prior_mean
        return self.prior_strength * (1.0 - mean)

    def to_dict(self) -> dict[str, Any]:
        # What asdict() gives (every field is a scalar but the candidates), without its deep
        # copy of each value: a job's state is serialised on every step report.
        out = {f: getattr(self, f) for f in _SAGC_CONFIG_FIELDS}
        out["candidates"] = list(self.candidates)
        if self.objective == "step":  # the default: a state an older release restores
            del out["objective"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SAGCConfig:
        kwargs = dict(data)
        if "candidates" in kwargs:
            kwargs["candidates"] = tuple(kwargs["candidates"])
        try:
            return cls(**kwargs)
        except TypeError as exc:  # unknown or missing keys
            raise ConfigError("config", str(exc)) from exc


_SAGC_CONFIG_FIELDS = tuple(f.name for f in fields(SAGCConfig))


@runtime_checkable
class GroupController(Protocol):
    """What the plan logic needs from a group-size controller (SAGC or fixed)."""

    @property
    def tau(self) -> float: ...
    @property
    def lambda_(self) -> float: ...
    @property
    def current(self) -> int: ...
    @property
    def pending(self) -> int | None: ...
    def decide(self, context: Mapping[int, float] | None = None) -> int: ...
    def observe(self, g: int, max_len: float, median_len: float,
                seconds: float | None = None, tokens: float | None = None) -> bool: ...
    def posterior_means(self) -> dict[int, float]: ...
    def posterior(self) -> dict[int, tuple[float, float]]: ...
    def per_size(self) -> dict[int, tuple[int, int]]: ...
    def state_dict(self) -> dict[str, Any]: ...


def _rng_state_to_json(rng: np.random.Generator) -> dict[str, Any]:
    st = rng.bit_generator.state
    if st["bit_generator"] != "PCG64":  # pragma: no cover - we only ever build PCG64
        raise StateError(f"unsupported bit generator {st['bit_generator']}")
    # 128-bit integers as hex strings: JSON readers other than Python's lose precision on
    # large integers, and the state travels through the Kubernetes API as JSON.
    return {
        "bit_generator": "PCG64",
        "state": format(st["state"]["state"], "#x"),
        "inc": format(st["state"]["inc"], "#x"),
        "has_uint32": int(st["has_uint32"]),
        "uinteger": int(st["uinteger"]),
    }


def _rng_from_json(data: dict[str, Any]) -> np.random.Generator:
    try:
        if data["bit_generator"] != "PCG64":
            raise StateError(f"rng.bit_generator must be PCG64, got {data['bit_generator']!r}")
        bg = np.random.PCG64()
        bg.state = {
            "bit_generator": "PCG64",
            "state": {"state": int(data["state"], 16), "inc": int(data["inc"], 16)},
            "has_uint32": int(data["has_uint32"]),
            "uinteger": int(data["uinteger"]),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise StateError(f"bad rng state: {exc}") from exc
    return np.random.Generator(bg)


@dataclass
class _Counters:
    steps: int = 0
    stragglers: int = 0
    per_size: dict[int, list[int]] = field(default_factory=dict)  # G -> [steps, stragglers]


class SAGCController:
    """Thompson-sampling primal-dual group-size controller. See the module docstring.

    ``decide()`` and ``observe()`` each cost a few microseconds (one vectorised Beta draw).
    """

    kind = "sagc"

    def __init__(self, cfg: SAGCConfig) -> None:
        if not isinstance(cfg, SAGCConfig):
            raise ConfigError("config", f"must be an SAGCConfig, got {type(cfg).__name__}")
        self._cfg = cfg
        n = len(cfg.candidates)
        self._alpha = [cfg.alpha0] * n
        self._beta = [cfg.beta0] * n
        self._lambda = 0.0
        self._index = cfg.candidates.index(cfg.initial)
        self._pending: int | None = None
        self._rng = np.random.Generator(np.random.PCG64(cfg.seed))
        self._utility = np.log2(np.asarray(cfg.candidates, dtype=np.float64))
        self._counters = _Counters(per_size={g: [0, 0] for g in cfg.candidates})
        # context (module docstring): [bin][candidate] with bin 0 = at or below the recent mean
        self._ctx_alpha = [[cfg.alpha0] * n, [cfg.alpha0] * n]
        self._ctx_beta = [[cfg.beta0] * n, [cfg.beta0] * n]
        self._ctx_recent: dict[int, list[float]] = {g: [] for g in cfg.candidates}
        self._pending_bin: int | None = None
        self._ctx_decisions = 0
        self._ctx_counts = [[0, 0], [0, 0]]  # per bin: [steps observed, straggler steps]
        # a step's seconds per candidate, forgotten like the posterior: sum and weight
        self._cost_num = [0.0] * n
        self._cost_den = [0.0] * n
        # the last TOKEN_HISTORY steps' [G, response tokens, seconds], oldest first
        self._tokens: list[list[float]] = []

    # --- read-only views ------------------------------------------------------------------
    @property
    def config(self) -> SAGCConfig:
        return self._cfg

    @property
    def tau(self) -> float:
        return self._cfg.tau

    @property
    def lambda_(self) -> float:
        """The current Lagrange multiplier, in [0, lambda_max]."""
        return self._lambda

    @property
    def current(self) -> int:
        """The G of the last observed step (``initial`` before any)."""
        return self._cfg.candidates[self._index]

    @property
    def pending(self) -> int | None:
        """The G decided and not yet observed, if any."""
        return self._pending

    @property
    def steps(self) -> int:
        return self._counters.steps

    @property
    def stragglers(self) -> int:
        return self._counters.stragglers

    def posterior_means(self) -> dict[int, float]:
        """``{G: E[p(G)]}``, the posterior mean straggler probability per candidate."""
        return {
            g: a / (a + b)
            for g, a, b in zip(self._cfg.candidates, self._alpha, self._beta, strict=True)
        }

    def posterior(self) -> dict[int, tuple[float, float]]:
        """``{G: (alpha_G, beta_G)}``."""
        return {
            g: (a, b) for g, a, b in zip(self._cfg.candidates, self._alpha, self._beta, strict=True)
        }

    def per_size(self) -> dict[int, tuple[int, int]]:
        """``{G: (steps observed, straggler steps)}`` per candidate, over the whole run."""
        return {g: (v[0], v[1]) for g, v in self._counters.per_size.items()}

    def step_seconds(self) -> dict[int, float]:
        """``{G: a step's seconds}`` of each size measured so far (forgotten like the
        posterior: a weighted mean with weight ``forgetting`` per later step of that size).
        Measured under the ``"second"`` objective only ({} otherwise)."""
        return {g: self._cost_num[i] / self._cost_den[i]
                for i, g in enumerate(self._cfg.candidates) if self._cost_den[i] > 0}

    def step_prices(self) -> dict[int, float]:
        """``{G: seconds}`` the objective per second prices a step of each candidate at now
        ({} before a step is measured, or under the ``"step"`` objective)."""
        costs = self._step_costs() if self._cfg.objective == "second" else None
        return {} if costs is None else dict(zip(self._cfg.candidates, costs, strict=True))

    def _step_costs(self) -> list[float] | None:
        """Every candidate's expected step seconds, None before any is measured.

        From the steps' response tokens where reported: ``k * G ** e_g * (tokens / G) ** e_len``
        fitted in logs to the last ``TOKEN_HISTORY`` steps of every size, weighted
        ``forgetting ** age``, at the last step's tokens per unit of G, so every size's price
        follows the lengths as they change (``e_g`` = 1 while one size is in the history: a
        smaller size looks cheaper and is tried). Else per size: a size not measured yet is
        priced from a line ``a + b * G`` fitted to the measured sizes, weighted by their
        forgotten counts; through the origin while one size is measured (module docstring)."""
        cands = self._cfg.candidates
        if self._tokens:
            gamma = self._cfg.forgetting
            n = len(self._tokens)
            w = [gamma ** (n - 1 - k) for k in range(n)]
            lg = [math.log(h[0]) for h in self._tokens]
            ll = [math.log(h[1] / h[0]) for h in self._tokens]
            ls = [math.log(h[2]) for h in self._tokens]
            # seconds = k * G ** e_g * (tokens / G) ** e_len, fitted in logs (module docstring)
            e_g, e_len, log_k = _fit_cost_surface(lg, ll, ls, w)
            now = ll[-1]  # the last step's tokens per unit of G: today's lengths
            return [math.exp(log_k + e_g * math.log(g) + e_len * now) for g in cands]
        w = self._cost_den
        seen = [i for i in range(len(cands)) if w[i] > 0]
        if not seen:
            return None
        mean = [self._cost_num[i] / w[i] if w[i] > 0 else 0.0 for i in range(len(cands))]
        a, b = _fit_cost_line([float(cands[i]) for i in seen], [mean[i] for i in seen],
                              [w[i] for i in seen])
        return [mean[i] if w[i] > 0 else a + b * g for i, g in enumerate(cands)]

    @property
    def context_decisions(self) -> int:
        """Decisions whose chosen G was drawn from a context's posterior."""
        return self._ctx_decisions

    def context_counts(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Steps observed with a context bin at their G, and straggler steps among them:
        ``((steps, stragglers) predicted at or below the recent mean, (...) above)``: what the
        context knows (equal rates: nothing)."""
        (a, b), (c, d) = self._ctx_counts
        return (a, b), (c, d)

    def context_posterior_means(self) -> dict[int, tuple[float, float]]:
        """``{G: (E[p(G) | low-risk round], E[p(G) | high-risk round])}``."""
        out: dict[int, tuple[float, float]] = {}
        for i, g in enumerate(self._cfg.candidates):
            a, b = self._ctx_alpha, self._ctx_beta
            out[g] = (a[0][i] / (a[0][i] + b[0][i]), a[1][i] / (a[1][i] + b[1][i]))
        return out

    def allowed(self) -> tuple[int, ...]:
        """Candidates reachable from the current G under the local-search radius."""
        lo = max(0, self._index - self._cfg.radius)
        hi = min(len(self._cfg.candidates), self._index + self._cfg.radius + 1)
        return self._cfg.candidates[lo:hi]

    def is_straggler(self, max_len: float, median_len: float) -> bool:
        return is_straggler(max_len, median_len, self._cfg.tau)

    # --- the algorithm --------------------------------------------------------------------
    def decide(self, context: Mapping[int, float] | None = None) -> int:
        """The group size for the next step (the same pending G until it is observed).

        ``context``: the next round's predicted straggler probability per candidate (module
        docstring); candidates it leaves out are drawn from their pooled posterior."""
        if self._pending is not None:
            return self._pending
        bins = self._bins(context)
        if self._counters.steps == 0:
            # Step 0 runs ``initial``, as documented (a Thompson draw would already move G
            # within the radius, before any evidence: initial 8 gave G=16 at step 0).
            self._pending = self._cfg.initial
            self._pending_bin = bins.get(self._pending)
            return self._pending
        r = self._cfg.radius
        lo = max(0, self._index - r)
        hi = min(len(self._cfg.candidates), self._index + r + 1)
        alpha, beta = list(self._alpha[lo:hi]), list(self._beta[lo:hi])
        ready: set[int] = set()
        for k, i in enumerate(range(lo, hi)):
            g = self._cfg.candidates[i]
            b = bins.get(g)
            if b is not None and len(self._ctx_recent[g]) > CONTEXT_MIN:
                alpha[k], beta[k] = self._ctx_alpha[b][i], self._ctx_beta[b][i]
                ready.add(g)
        draws = self._rng.beta(alpha, beta)
        utility = self._utility[lo:hi]
        costs = self._step_costs() if self._cfg.objective == "second" else None
        if costs is not None:
            # log2(G) per second, in units of the current size's step (module docstring)
            utility = utility * costs[self._index] / np.asarray(costs[lo:hi])
        scores = utility - self._lambda * draws
        self._pending = self._cfg.candidates[lo + int(np.argmax(scores))]
        self._pending_bin = bins.get(self._pending)
        self._ctx_decisions += self._pending in ready
        return self._pending

    def _bins(self, context: Mapping[int, float] | None) -> dict[int, int]:
        """Each candidate's context bin (0: at or below its recent mean, 1: above), and
        the context remembered; candidates with no context or no history yet are left out."""
        if not context:
            return {}
        known = {g: float(x) for g, x in context.items() if g in self._ctx_recent}
        for g, x in known.items():  # all checked before any is remembered
            if not 0.0 <= x <= 1.0:  # NaN fails this too
                raise ObservationError(
                    f"context[{g}] must be a probability in [0, 1], got {x!r}")
        out: dict[int, int] = {}
        for g, x in known.items():
            recent = self._ctx_recent[g]
            if recent:
                out[g] = int(x > math.fsum(recent) / len(recent))
            recent.append(x)
            del recent[:-CONTEXT_HISTORY]
        return out

    def observe(self, g: int, max_len: float, median_len: float,
                seconds: float | None = None, tokens: float | None = None) -> bool:
        """Record the length summary of the step run with the decided ``g``, and its wall
        clock ``seconds`` and response ``tokens`` when measured (None or 0: not measured; the
        ``"second"`` objective prices each size from these).

        Returns whether the step was a straggler. Raises :class:`ObservationError` (and
        changes nothing) for a G that was not decided, impossible lengths or seconds.
        """
        if self._pending is None:
            raise ObservationError(
                f"observe(g={g}) without a pending decision: call decide() first and run the"
                " step with the G it returns"
            )
        if g != self._pending:
            raise ObservationError(
                f"observe(g={g}) but the decided group size is {self._pending}: report the G"
                " that decide() returned"
            )
        mx, med = _check_lengths(max_len, median_len)
        secs = _check_seconds(seconds)
        toks = _check_seconds(tokens, "tokens")
        s = 1.0 if is_straggler(mx, med, self._cfg.tau) else 0.0
        cfg = self._cfg
        gamma = cfg.forgetting
        chosen = cfg.candidates.index(g)
        if secs and cfg.objective == "second":
            self._cost_num[chosen] = gamma * self._cost_num[chosen] + secs
            self._cost_den[chosen] = gamma * self._cost_den[chosen] + 1.0
            if toks:
                self._tokens = [*self._tokens, [float(g), toks, secs]][-TOKEN_HISTORY:]
        for i in range(len(cfg.candidates)):
            if i == chosen:
                self._alpha[i] = max(gamma * self._alpha[i] + s, _MIN_PSEUDO_COUNT)
                self._beta[i] = max(gamma * self._beta[i] + (1.0 - s), _MIN_PSEUDO_COUNT)
            elif cfg.decay_unchosen:
                self._alpha[i] = gamma * self._alpha[i] + (1.0 - gamma) * cfg.alpha0
                self._beta[i] = gamma * self._beta[i] + (1.0 - gamma) * cfg.beta0
        b = self._pending_bin
        if b is not None:
            ca, cb = self._ctx_alpha[b], self._ctx_beta[b]
            ca[chosen] = max(gamma * ca[chosen] + s, _MIN_PSEUDO_COUNT)
            cb[chosen] = max(gamma * cb[chosen] + (1.0 - s), _MIN_PSEUDO_COUNT)
            self._ctx_counts[b][0] += 1
            self._ctx_counts[b][1] += int(s)
        if cfg.decay_unchosen:
            for bb in (0, 1):
                for i in range(len(cfg.candidates)):
                    if (bb, i) != (b, chosen):
                        self._ctx_alpha[bb][i] = (gamma * self._ctx_alpha[bb][i]
                                                  + (1.0 - gamma) * cfg.alpha0)
                        self._ctx_beta[bb][i] = (gamma * self._ctx_beta[bb][i]
                                                 + (1.0 - gamma) * cfg.beta0)
        self._lambda = min(max(self._lambda + cfg.dual_step * (s - cfg.delta), 0.0), cfg.lambda_max)
        self._index = chosen
        self._pending = None
        self._pending_bin = None
        self._counters.steps += 1
        self._counters.stragglers += int(s)
        per = self._counters.per_size[g]
        per[0] += 1
        per[1] += int(s)
        return bool(s)

    # --- reconfiguration (run-time policy) -----------------------------------------------
    def reconfigure(self, cfg: SAGCConfig) -> None:
        """Switch to ``cfg`` (new candidates and/or delta), keeping what was learnt.

        Deterministic (a function of the state and ``cfg``), so hosts that persist the state
        after it stay bit-exact. A candidate kept keeps its posterior and counters; a new one
        starts at ``cfg``'s prior. ``current`` moves to the nearest new candidate (ties: the
        smaller) when dropped; a pending G that is dropped is re-decided (with the persisted
        generator). Lambda is kept (clipped to ``cfg.lambda_max``), and so are the measured
        step seconds of the sizes kept and every step's tokens (a price per token holds
        whatever sizes are allowed).
        """
        if not isinstance(cfg, SAGCConfig):
            raise ConfigError("config", f"must be an SAGCConfig, got {type(cfg).__name__}")
        old = self._cfg
        if cfg == old:
            return
        post = dict(zip(old.candidates, zip(self._alpha, self._beta, strict=True), strict=True))
        current = self.current
        pending = self._pending
        self._cfg = cfg
        self._alpha = [post[g][0] if g in post else cfg.alpha0 for g in cfg.candidates]
        self._beta = [post[g][1] if g in post else cfg.beta0 for g in cfg.candidates]
        self._lambda = min(self._lambda, cfg.lambda_max)
        if current not in cfg.candidates:
            current = min(cfg.candidates, key=lambda g: (abs(g - current), g))
        self._index = cfg.candidates.index(current)
        self._utility = np.log2(np.asarray(cfg.candidates, dtype=np.float64))
        self._counters.per_size = {
            g: list(self._counters.per_size.get(g, [0, 0])) for g in cfg.candidates
        }
        for arms, prior in ((self._ctx_alpha, cfg.alpha0), (self._ctx_beta, cfg.beta0)):
            for b in (0, 1):
                was = dict(zip(old.candidates, arms[b], strict=True))
                arms[b] = [was.get(g, prior) for g in cfg.candidates]
        self._ctx_recent = {g: self._ctx_recent.get(g, []) for g in cfg.candidates}
        cost = dict(zip(old.candidates, zip(self._cost_num, self._cost_den, strict=True),
                        strict=True))
        self._cost_num = [cost.get(g, (0.0, 0.0))[0] for g in cfg.candidates]
        self._cost_den = [cost.get(g, (0.0, 0.0))[1] for g in cfg.candidates]
        self._pending = pending if pending in cfg.candidates else None
        if self._pending is None:
            self._pending_bin = None
        if self._pending is None and pending is not None:
            self.decide()

    # --- persistence ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; :meth:`from_state_dict` continues bit for bit."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "version": _STATE_VERSION,
            "config": self._cfg.to_dict(),
            "alpha": list(self._alpha),
            "beta": list(self._beta),
            "lambda": self._lambda,
            "current": self.current,
            "pending": self._pending,
            "steps": self._counters.steps,
            "stragglers": self._counters.stragglers,
            "per_size": {str(g): list(v) for g, v in self._counters.per_size.items()},
            "rng": _rng_state_to_json(self._rng),
            "context": {
                "alpha": [list(a) for a in self._ctx_alpha],
                "beta": [list(b) for b in self._ctx_beta],
                "recent": {str(g): list(v) for g, v in self._ctx_recent.items()},
                "pending_bin": self._pending_bin,
                "decisions": self._ctx_decisions,
                "counts": [list(c) for c in self._ctx_counts],
            },
        }
        if self._cfg.objective == "second":  # only then: a per-step state as older releases wrote
            out["step_seconds"] = {"sum": list(self._cost_num), "weight": list(self._cost_den)}
            out["step_tokens"] = [list(h) for h in self._tokens]
        return out

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> SAGCController:
        _check_header(state, cls.kind)
        try:
            cfg = SAGCConfig.from_dict(state["config"])
            ctl = cls(cfg)
            n = len(cfg.candidates)
            alpha = [float(x) for x in state["alpha"]]
            beta = [float(x) for x in state["beta"]]
            if len(alpha) != n or len(beta) != n:
                raise StateError(f"alpha/beta must have {n} entries (one per candidate)")
            if not all(math.isfinite(x) and x > 0 for x in alpha + beta):
                raise StateError("alpha/beta must be positive and finite")
            lam = float(state["lambda"])
            if not 0.0 <= lam <= cfg.lambda_max:
                raise StateError(f"lambda {lam} outside [0, {cfg.lambda_max}]")
            current = int(state["current"])
            pending = state["pending"]
            if current not in cfg.candidates or (
                pending is not None and int(pending) not in cfg.candidates
            ):
                raise StateError("current/pending must be candidates")
            ctl._alpha, ctl._beta, ctl._lambda = alpha, beta, lam
            ctl._index = cfg.candidates.index(current)
            ctl._pending = None if pending is None else int(pending)
            ctl._counters = _Counters(
                steps=int(state["steps"]),
                stragglers=int(state["stragglers"]),
                per_size={int(g): [int(v[0]), int(v[1])] for g, v in state["per_size"].items()},
            )
            ctl._rng = _rng_from_json(state["rng"])
            ctx = state.get("context")  # absent in a state written before contexts
            if ctx is not None:
                ca = [[float(x) for x in row] for row in ctx["alpha"]]
                cb = [[float(x) for x in row] for row in ctx["beta"]]
                if len(ca) != 2 or len(cb) != 2 or any(len(r) != n for r in ca + cb):
                    raise StateError(f"context alpha/beta must be 2 x {n}")
                if not all(math.isfinite(x) and x > 0 for r in ca + cb for x in r):
                    raise StateError("context alpha/beta must be positive and finite")
                recent = {int(g): [float(x) for x in v] for g, v in ctx["recent"].items()}
                if set(recent) != set(cfg.candidates):
                    raise StateError("context.recent must name every candidate")
                pb = ctx["pending_bin"]
                if pb not in (None, 0, 1):
                    raise StateError(f"context.pending_bin must be 0, 1 or null, got {pb!r}")
                ctl._ctx_alpha, ctl._ctx_beta, ctl._ctx_recent = ca, cb, recent
                ctl._pending_bin = pb
                ctl._ctx_decisions = int(ctx["decisions"])
                ctl._ctx_counts = [[int(x) for x in c] for c in ctx["counts"]]
                if len(ctl._ctx_counts) != 2 or any(len(c) != 2 for c in ctl._ctx_counts):
                    raise StateError("context.counts must be 2 x 2")
            cost = state.get("step_seconds")  # absent in a state written before costs
            if cost is not None:
                num = [float(x) for x in cost["sum"]]
                den = [float(x) for x in cost["weight"]]
                if len(num) != n or len(den) != n:
                    raise StateError(f"step_seconds must have {n} entries per list")
                if not all(math.isfinite(x) and x >= 0 for x in num + den):
                    raise StateError("step_seconds must be finite and >= 0")
                ctl._cost_num, ctl._cost_den = num, den
            toks = state.get("step_tokens", [])  # absent in a state written before tokens
            hist = [[float(v) for v in h] for h in toks]
            if len(hist) > TOKEN_HISTORY or any(
                    len(h) != 3 or not all(math.isfinite(v) and v > 0 for v in h) for h in hist):
                raise StateError(f"step_tokens must be at most {TOKEN_HISTORY} [G, tokens,"
                                 " seconds] entries, each finite and > 0")
            ctl._tokens = hist
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, StateError | ConfigError):
                raise
            raise StateError(f"cannot restore SAGCController: {exc!r}") from exc
        return ctl


def _check_header(state: Any, kind: str) -> None:
    if not isinstance(state, dict):
        raise StateError(f"state must be a dict, got {type(state).__name__}")
    if state.get("kind") != kind:
        raise StateError(f"state is of kind {state.get('kind')!r}, expected {kind!r}")
    if state.get("version") != _STATE_VERSION:
        raise StateError(f"unsupported state version {state.get('version')!r}")


@dataclass(frozen=True)
class FixedConfig:
    """Configuration of :class:`FixedController` (always the same G)."""

    group_size: int = 8
    """The group size of every step (>= 1)."""
    tau: float = 4.0
    """Straggler threshold, only for reporting the straggler rate and p(G) (> 1)."""
    forgetting: float = 0.95
    """Forgetting factor of the reported p(G) posterior, in (0, 1]."""
    prior_alpha: float = 1.0
    """Prior pseudo-count of straggler steps of the reported p(G) (> 0)."""
    prior_beta: float = 1.0
    """Prior pseudo-count of normal steps of the reported p(G) (> 0)."""

    def __post_init__(self) -> None:
        require_int("group_size", self.group_size, minimum=1)
        require_float("tau", self.tau, low=1, low_open=True)
        require_float("forgetting", self.forgetting, low=0, high=1, low_open=True)
        require_float("prior_alpha", self.prior_alpha, low=0, low_open=True)
        require_float("prior_beta", self.prior_beta, low=0, low_open=True)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FixedConfig:
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError("config", str(exc)) from exc


class FixedController:
    """A constant group size with SAGCController's interface (baselines, ``mode: Fixed``)."""

    kind = "fixed"

    def __init__(self, cfg: FixedConfig) -> None:
        if not isinstance(cfg, FixedConfig):
            raise ConfigError("config", f"must be a FixedConfig, got {type(cfg).__name__}")
        self._cfg = cfg
        self._alpha = float(cfg.prior_alpha)
        self._beta = float(cfg.prior_beta)
        self._pending: int | None = None
        self._steps = 0
        self._stragglers = 0

    @property
    def config(self) -> FixedConfig:
        return self._cfg

    @property
    def tau(self) -> float:
        return self._cfg.tau

    @property
    def lambda_(self) -> float:
        return 0.0

    @property
    def current(self) -> int:
        return self._cfg.group_size

    @property
    def pending(self) -> int | None:
        return self._pending

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def stragglers(self) -> int:
        return self._stragglers

    def posterior_means(self) -> dict[int, float]:
        return {self._cfg.group_size: self._alpha / (self._alpha + self._beta)}

    def posterior(self) -> dict[int, tuple[float, float]]:
        """``{G: (alpha, beta)}`` of the one size."""
        return {self._cfg.group_size: (self._alpha, self._beta)}

    def per_size(self) -> dict[int, tuple[int, int]]:
        """``{G: (steps observed, straggler steps)}`` of the one size."""
        return {self._cfg.group_size: (self._steps, self._stragglers)}

    def is_straggler(self, max_len: float, median_len: float) -> bool:
        return is_straggler(max_len, median_len, self._cfg.tau)

    def decide(self, context: Mapping[int, float] | None = None) -> int:
        """The one size (``context`` is ignored: there is nothing to choose)."""
        self._pending = self._cfg.group_size
        return self._pending

    def observe(self, g: int, max_len: float, median_len: float,
                seconds: float | None = None, tokens: float | None = None) -> bool:
        """As :meth:`SAGCController.observe` (``seconds`` and ``tokens`` are checked, not
        used: there is one size)."""
        if self._pending is None:
            raise ObservationError(f"observe(g={g}) without a pending decision: call decide()")
        if g != self._cfg.group_size:
            raise ObservationError(
                f"observe(g={g}) but the fixed group size is {self._cfg.group_size}"
            )
        mx, med = _check_lengths(max_len, median_len)
        _check_seconds(seconds)
        _check_seconds(tokens, "tokens")
        s = 1.0 if is_straggler(mx, med, self._cfg.tau) else 0.0
        gamma = self._cfg.forgetting
        self._alpha = max(gamma * self._alpha + s, _MIN_PSEUDO_COUNT)
        self._beta = max(gamma * self._beta + (1.0 - s), _MIN_PSEUDO_COUNT)
        self._pending = None
        self._steps += 1
        self._stragglers += int(s)
        return bool(s)

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "version": _STATE_VERSION,
            "config": self._cfg.to_dict(),
            "alpha": self._alpha,
            "beta": self._beta,
            "pending": self._pending,
            "steps": self._steps,
            "stragglers": self._stragglers,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> FixedController:
        _check_header(state, cls.kind)
        try:
            ctl = cls(FixedConfig.from_dict(state["config"]))
            ctl._alpha, ctl._beta = float(state["alpha"]), float(state["beta"])
            pending = state["pending"]
            ctl._pending = None if pending is None else int(pending)
            ctl._steps, ctl._stragglers = int(state["steps"]), int(state["stragglers"])
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, StateError | ConfigError):
                raise
            raise StateError(f"cannot restore FixedController: {exc!r}") from exc
        return ctl


class GroupControlMode(enum.StrEnum):
    """How a job picks its group size. Values match the API's ``groupControl.mode``."""

    SAGC = "SAGC"
    FIXED = "Fixed"

    @classmethod
    def parse(cls, name: str | GroupControlMode) -> GroupControlMode:
        """Case-insensitive lookup by value or member name; unknown names raise."""
        if isinstance(name, cls):
            return name
        if isinstance(name, enum.Enum):  # e.g. the API layer's enum of the same values
            name = str(name.value)
        if isinstance(name, str):
            for member in cls:
                if name.lower() in (member.value.lower(), member.name.lower()):
                    return member
        raise ConfigError(
            "mode", f"unknown group-control mode {name!r}; expected one of {[m.value for m in cls]}"
        )


def make_controller(
    mode: GroupControlMode | str, cfg: SAGCConfig | None = None
) -> SAGCController | FixedController:
    """Build the controller for ``mode`` from one SAGCConfig (Fixed uses ``cfg.initial``,
    ``cfg.tau`` and ``cfg.forgetting``)."""
    cfg = SAGCConfig() if cfg is None else cfg
    parsed = GroupControlMode.parse(mode)
    if parsed is GroupControlMode.SAGC:
        return SAGCController(cfg)
    return FixedController(
        FixedConfig(
            group_size=cfg.initial,
            tau=cfg.tau,
            forgetting=cfg.forgetting,
            prior_alpha=cfg.alpha0,
            prior_beta=cfg.beta0,
        )
    )


_BY_KIND: dict[str, type[SAGCController] | type[FixedController]] = {
    SAGCController.kind: SAGCController,
    FixedController.kind: FixedController,
}


def controller_from_state_dict(state: dict[str, Any]) -> SAGCController | FixedController:
    """Restore whichever controller ``state`` came from."""
    if not isinstance(state, dict) or state.get("kind") not in _BY_KIND:
        kind = state.get("kind") if isinstance(state, dict) else None
        raise StateError(f"unknown controller kind {kind!r}; expected one of {sorted(_BY_KIND)}")
    return _BY_KIND[state["kind"]].from_state_dict(state)
