"""The learner: a torch policy updated with GRPO/DAPO losses on finished rollouts.

Padding and positions: sequences (prompt + response) are *right*-padded and the forward pass
gets explicit ``position_ids = 0..L-1``, which are exactly the positions vLLM uses when it
samples a lone unpadded sequence. (DESIGN.md's prototype lost all reward in 15 steps by
left-padding without matching position ids: the update then differs from the sampling policy.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from rlpacer_trainer import algos, weights
from rlpacer_trainer.tiny import PAD_ID


@dataclasses.dataclass
class Sample:
    """One response to train on: token ids and its (scalar) advantage."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float


def pack(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pads prompt+response pairs.

    Returns ``input_ids`` [B, L], ``attention_mask`` [B, L], ``position_ids`` [B, L],
    ``targets`` [B, L-1] (the next token at each position) and ``response_mask`` [B, L-1]
    (1.0 where the target is a response token).
    """
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
    width = max(len(s) for s in seqs)
    b = len(seqs)
    ids = torch.full((b, width), PAD_ID, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    rmask = torch.zeros((b, width - 1), dtype=torch.float32)
    for i, (s, p) in enumerate(zip(seqs, prompts, strict=True)):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, : len(s)] = 1
        # target at t is token t+1: response tokens are targets len(p)-1 .. len(s)-2
        rmask[i, len(p) - 1 : len(s) - 1] = 1.0
    pos = torch.arange(width, dtype=torch.long).unsqueeze(0).expand(b, width).contiguous()
    return ids, attn, pos, ids[:, 1:].contiguous(), rmask


def sequence_logprobs(model: Any, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor,
                      targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probabilities of ``targets`` [B, L-1] under ``model``, with logits divided
    by the sampling ``temperature`` (so the update is for the policy that actually sampled)."""
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False)
    logits = out.logits[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    return algos.token_logprobs(logits, targets)


@dataclasses.dataclass
class LearnerConfig:
    """Learner settings (built from the job's ``spec.algorithm``; see config.py)."""

    learning_rate: float = 1e-4
    clip_low: float = 0.2
    clip_high: float = 0.2
    aggregation: str = algos.LossAggregation.TOKEN_MEAN.value
    kl_coef: float = 0.0
    mini_batches: int = 2
    max_grad_norm: float = 1.0
    temperature: float = 1.0  # the rollout's sampling temperature
    # linear learning-rate warm-up over this many optimizer steps (0: none). A fresh AdamW's
    # first updates are ~lr * sign(grad) for every parameter (its second moment is one
    # squared gradient): on a noisy policy gradient that is a random kick to all weights.
    warmup_updates: int = 0
    # square-root batch scaling (Adam's scaling rule, Malladi et al. 2022): an update on n
    # samples uses lr * sqrt(min(1, n / reference_samples)); 0 turns it off. With SAGC the
    # batch shrinks with G, and AdamW takes a full-size step on a 4x noisier gradient
    # otherwise (measured: held-out greedy accuracy dipped 6 points in 8 steps at G=4).
    reference_samples: int = 0
    # mixed precision: forward passes under torch.autocast in this dtype ("bfloat16" on GPU
    # learners), master weights and optimizer state stay float32; None or "float32": full
    # float32 (LearnerWorker turns None into "bfloat16" on a GPU: spec.model.dtype unset)
    autocast: str | None = None
    # padded tokens (rows x longest sequence) per forward/backward pass on one rank: a
    # mini-batch is split into micro-batches of at most this many, their gradients summed
    # (0: one pass per mini-batch). Bounds a step's activation memory whatever G and the
    # response lengths are (spec.trainer.microBatchTokens).
    micro_batch_tokens: int = 0
    # "FSDP" (sharded over the ranks, :mod:`rlpacer_trainer.sharding`) or "Replicated" (a full
    # copy per rank, gradients all-reduced): spec.trainer.sharding. A single CPU rank is never
    # sharded (nothing to shard)
    sharding: str = "Replicated"
    activation_checkpointing: bool = False  # spec.trainer.activationCheckpointing
    # the engines' dtype: the weights are published in it and fingerprinted as the engines
    # hold them (None: as the learner holds them)
    publish_dtype: str | None = None
    # a sharded learner publishes its weights in buckets of at most this many bytes
    publish_bucket_bytes: int = 256 << 20


def _raw_count(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What a mini-batch part adds to its loss's denominator (before clamping)."""
    if algos.LossAggregation(mode) is algos.LossAggregation.TOKEN_MEAN:
        return mask.sum().to(torch.float64)
    return torch.tensor(float(mask.shape[0]), dtype=torch.float64)


@dataclasses.dataclass
class Shard:
    """This rank's part of a data-parallel update: the positions of its samples in the whole
    batch (``total`` samples), and the process group the ranks sum over (None: the default
    group of ``torch.distributed``, gloo on CPU, NCCL on GPU)."""

    positions: Sequence[int]
    total: int
    group: Any = None

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        import torch.distributed as dist

        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                        group=self.group)
        return t

    def all_reduce_grads(self, params: Any) -> None:
        """Sums every parameter's gradient over the ranks (one flat buffer, one collective)."""
        import torch.distributed as dist

        ps = [p for p in params if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        off = 0
        for p, g in zip(ps, grads, strict=True):
            p.grad = flat[off: off + g.numel()].view_as(g).clone()
            off += g.numel()


@dataclasses.dataclass
class _Stream:
    """A step streamed in (:meth:`Learner.stream_add`): the passes made before the batch is
    whole. Samples by position; the later mini-batches' behaviour log-probs and the reference
    model's, each row as long as its sample (prompt + response, less one)."""

    k: int
    samples: dict[int, Sample] = dataclasses.field(default_factory=dict)
    old: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    ref: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    loss_sum: float = 0.0  # the first mini-batch's, not yet divided by its count
    kl_sum: float = 0.0
    clipped: float = 0.0
    tokens: float = 0.0
    passes: int = 0
    busy_s: float = 0.0
    broken: str | None = None


class Learner:
    """Owns the policy, its optimizer and (when ``kl_coef > 0``) a frozen reference copy."""

    def __init__(self, model: Any, cfg: LearnerConfig, *, fsdp: bool = False,
                 ref: Any = None) -> None:
        """``fsdp``: ``model`` (and ``ref``, the frozen reference model, given when
        ``kl_coef > 0``) are sharded with FSDP (:mod:`rlpacer_trainer.sharding`): every rank
        makes the same passes, and FSDP reduces the gradients itself."""
        self.model = model
        self.cfg = cfg
        self.fsdp = fsdp
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=0.0)
        self.updates = 0  # optimizer steps taken (drives the warm-up)
        self._stream: _Stream | None = None
        self.ref = ref
        if cfg.kl_coef > 0 and ref is None:
            import copy

            self.ref = copy.deepcopy(model).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)

    def train_step(self, samples: Sequence[Sample], shard: Shard | None = None,
                   mini_batches: int | None = None) -> dict[str, float]:
        """One policy update on ``samples`` (split into ``mini_batches`` optimizer steps:
        the argument when given, e.g. a long round that trains several steps' prompts at
        once, else ``cfg.mini_batches``).

        The behaviour log-probabilities are the learner's own, taken before the first
        optimizer step: the first mini-batch's are its forward pass's, detached (exactly
        on-policy, ratio 1), the later ones' come from one no-grad pass over their samples
        and are clipped with DAPO's low/high ratios. Passes per step: k forward and k
        backward for ``k`` mini-batches, plus one no-grad forward over (k-1)/k of the batch
        (none at k = 1), plus the reference model's forward with KL on. (The policy is in
        train mode throughout; the models here have no dropout, so a no-grad pass and the
        grad pass give the same log-probs.) Each of these passes is split into micro-batches
        of at most ``cfg.micro_batch_tokens`` padded tokens whose gradients are summed (each
        loss normalized by the whole mini-batch's count): the same update, memory bounded by
        the budget.

        With ``shard`` (data parallel), ``samples`` are this rank's part of a batch of
        ``shard.total``: mini-batches are formed by position in the whole batch, each loss is
        normalized by the whole mini-batch's count, and gradients are summed over the ranks
        before clipping (by the all-reduce of :class:`Shard`, or FSDP's reduce-scatter when
        ``fsdp``), so every rank takes exactly the update a single learner would take on the
        whole batch (up to float summation order).
        """
        n = shard.total if shard is not None else len(samples)
        if n == 0:
            return {"loss": 0.0, "clipfrac": 0.0, "kl": 0.0, "samples": 0.0, "updates": 0.0}
        positions = list(shard.positions) if shard is not None else list(range(len(samples)))
        if len(positions) != len(samples):
            raise ValueError(f"shard has {len(positions)} positions for {len(samples)} samples")
        self.model.train()
        return self._train_step(samples, shard, n, positions, self._k(mini_batches))

    def _autocast(self) -> Any:
        import contextlib

        if self.cfg.autocast in (None, "float32"):
            return contextlib.nullcontext()
        device = next(self.model.parameters()).device.type
        return torch.autocast(device_type=device, dtype=getattr(torch, self.cfg.autocast))

    def _micro_batches(self, idx: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
        """``idx`` split, in order, into micro-batches of at most ``micro_batch_tokens`` padded
        tokens (rows x the longest sequence's length) each; a sequence longer than the budget
        is a micro-batch of its own. A budget of 0: one micro-batch."""
        budget = self.cfg.micro_batch_tokens
        if not idx:
            return []
        if budget <= 0:
            return [list(idx)]
        out: list[list[int]] = []
        cur: list[int] = []
        width = 0
        for i in idx:
            w = max(width, int(lengths[i]))
            if cur and (len(cur) + 1) * w > budget:
                out.append(cur)
                cur, w = [], int(lengths[i])
            cur.append(i)
            width = w
        out.append(cur)
        return out

    def _even(self, parts: list[list[int]], shard: Shard | None) -> list[list[int]]:
        """Sharded (FSDP) ranks run the same number of passes (each forward gathers every
        layer's shards, each backward reduce-scatters their gradients, together on all
        ranks): ``parts`` padded with empty micro-batches (a dummy pass) up to the most any
        rank has."""
        if not self.fsdp or shard is None:
            return parts
        most = int(shard.all_reduce(torch.tensor(len(parts)), op="max"))
        return parts + [[] for _ in range(most - len(parts))]

    def _dummy_pass(self, model: Any, *, backward: bool) -> None:
        """A rank's share of a sharded pass it has no samples for: a two-token forward (and a
        backward of a zero loss: gradients of 0, reduced with the other ranks')."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self._device())
        pos = torch.arange(2, device=ids.device).unsqueeze(0)
        with self._autocast():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=pos,
                        use_cache=False)
        if backward:
            (out.logits.float().sum() * 0.0).backward()  # type: ignore[no-untyped-call]

    def _device(self) -> torch.device:
        return torch.device(next(self.model.parameters()).device)

    def _logprobs(self, model: Any, packed: Any, sel: torch.Tensor) -> torch.Tensor:
        ids, attn, pos, tgt, _ = packed
        w = int(attn[sel].sum(dim=1).max())
        dev = self._device()
        return sequence_logprobs(model, ids[sel, :w].to(dev), attn[sel, :w].to(dev),
                                 pos[sel, :w].to(dev), tgt[sel, : w - 1].to(dev),
                                 self.cfg.temperature).float().cpu()

    def _k(self, mini_batches: int | None) -> int:
        """The optimizer steps asked of one update (at least 1; more than its samples are
        not taken)."""
        if mini_batches is None:
            return max(1, int(self.cfg.mini_batches))
        if isinstance(mini_batches, bool) or not isinstance(mini_batches, int):
            raise TypeError(f"mini_batches must be an int, got {mini_batches!r}")
        return max(1, mini_batches)

    def _train_step(self, samples: Sequence[Sample], shard: Shard | None, n: int,
                    positions: list[int], asked: int) -> dict[str, float]:
        packed = old = ref = adv = None
        lengths: list[int] = []
        k = max(1, min(asked, n))
        # a fixed (not random) split keeps the update deterministic for resume tests
        chunks = [[i for i, g in enumerate(positions) if g % k == j] for j in range(k)]
        if samples:
            packed = pack([s.prompt_ids for s in samples], [s.response_ids for s in samples])
            lengths = [int(v) for v in packed[1].sum(dim=1)]
            adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
            old = torch.zeros(packed[3].shape, dtype=torch.float32)
            if self.ref is not None:
                ref = torch.zeros(packed[3].shape, dtype=torch.float32)
        # behaviour log-probs: the first mini-batch's are its own forward's (detached, below:
        # it runs before any optimizer step), so the no-grad pass covers only the later
        # mini-batches' samples (none with one mini-batch); then the reference model's
        later = [i for c in chunks[1:] for i in c]
        self._no_grad_logprobs(self.model, later, packed, lengths, old, shard)
        if self.ref is not None:
            self._no_grad_logprobs(self.ref, list(range(len(samples))), packed, lengths, ref,
                                   shard)
        stats = {"loss": 0.0, "clipfrac": 0.0, "kl": 0.0, "micro_batches": 0.0}
        for j, idx in enumerate(chunks):
            denom = self._denominator(idx, packed, shard)
            self.opt.zero_grad(set_to_none=True)
            sums = self._passes(j, idx, packed, lengths, old, ref, adv, denom, shard)
            self._update(n, shard)
            self._add_stats(stats, sums, k)
        stats.update(samples=float(n), updates=float(k))
        return stats

    def _denominator(self, idx: list[int], packed: Any, shard: Shard | None) -> torch.Tensor:
        """A mini-batch's loss denominator: its whole count (all micro-batches, all ranks)."""
        count = torch.zeros((), dtype=torch.float64)
        if idx:
            assert packed is not None
            count = _raw_count(packed[4][torch.tensor(idx, dtype=torch.long)],
                               self.cfg.aggregation)
        if shard is not None:
            count = shard.all_reduce(count)
        return count.clamp_min(1.0).to(torch.float32)

    def _passes(self, j: int, idx: list[int], packed: Any, lengths: list[int],
                old: torch.Tensor | None, ref: torch.Tensor | None, adv: torch.Tensor | None,
                denom: torch.Tensor, shard: Shard | None) -> list[float]:
        """Mini-batch ``j``'s forward and backward passes over samples ``idx``, micro-batch
        by micro-batch, gradients summed into the parameters'. Returns [loss, kl, clipped
        tokens, tokens, passes]."""
        cfg = self.cfg
        loss_sum = kl_sum = clipped = tokens = 0.0
        parts = self._even(self._micro_batches(idx, lengths), shard)
        for mb in parts:
            if not mb:
                self._dummy_pass(self.model, backward=True)
                continue
            assert packed is not None and adv is not None
            sel = torch.tensor(mb, dtype=torch.long)
            width = max(lengths[i] for i in mb)
            m = packed[4][sel, : width - 1]
            with self._autocast():  # the forward pass only; backward follows its dtypes
                logp = self._logprobs_grad(packed, sel)
            dev = logp.device
            m = m.to(dev)
            if j == 0:
                behaviour = logp.detach()
            else:
                assert old is not None
                behaviour = old[sel, : width - 1].to(dev)
            loss, st = algos.clipped_policy_loss(
                logp, behaviour, adv[sel].to(dev), m,
                clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                aggregation=cfg.aggregation, denominator=denom,
            )
            if ref is not None:
                kl = algos.aggregate(algos.kl_k3(logp, ref[sel, : width - 1].to(dev)), m,
                                     cfg.aggregation, denom)
                loss = loss + cfg.kl_coef * kl
                kl_sum += float(kl.detach())
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
            loss_sum += float(loss.detach())
            ntok = float(m.sum())
            clipped += st["clipfrac"] * ntok
            tokens += ntok
        return [loss_sum, kl_sum, clipped, tokens, float(len(parts))]

    def _update(self, n: int, shard: Shard | None) -> None:
        """One optimizer step on the summed gradients (the ranks' summed first)."""
        if shard is not None and not self.fsdp:
            shard.all_reduce_grads(self.model.parameters())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self._set_lr(n)
        self.opt.step()
        self.updates += 1

    @staticmethod
    def _add_stats(stats: dict[str, float], sums: list[float], k: int) -> None:
        loss_sum, kl_sum, clipped, tokens, passes = sums
        stats["loss"] += loss_sum / k
        stats["clipfrac"] += (clipped / tokens if tokens else 0.0) / k
        stats["kl"] += kl_sum / k
        stats["micro_batches"] += passes

    # --- a step streamed in as its groups finish ----------------------------------------------
    def stream_begin(self, mini_batches: int | None = None) -> bool:
        """Starts a step whose samples come in parts (:meth:`stream_add`) while the rollout
        runs; :meth:`stream_finish` completes it with the same update :meth:`train_step` takes
        on the whole batch (up to float summation order). Sharded (FSDP) ranks make every
        pass together: each must be given every part (its share of it, maybe none)."""
        self._stream = None
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        self._stream = _Stream(k=self._k(mini_batches))
        return True

    def stream_add(self, samples: Sequence[Sample], positions: Sequence[int]) -> None:
        """Samples of the step at their positions in the whole batch (this rank's; any
        order, each once). The passes that need only the weights the step starts from are made
        now: the first mini-batch's forward and backward (its gradients summed, not yet divided
        by its count, which is known only when the batch is whole), and the no-grad passes for
        the later mini-batches' behaviour log-probs and the reference model's."""
        import time

        st = self._stream
        if st is None:
            return
        if len(samples) != len(positions) or len(set(positions)) != len(positions) or any(
                pos in st.samples for pos in positions):
            st.broken = st.broken or (f"positions {list(positions)} repeat or do not match"
                                      f" the samples")
        if st.broken is not None:
            if not self.fsdp:
                return
            samples, positions = [], []  # a sharded rank still makes its share of the passes
        elif not samples and not self.fsdp:
            return
        # sharded: the passes gather and reduce with the other ranks, as many on each
        comm = Shard(list(positions), 0) if self.fsdp else None
        t0 = time.perf_counter()
        for pos, smp in zip(positions, samples, strict=True):
            st.samples[pos] = smp
        packed: Any = None
        lengths: list[int] = []
        adv = rows = ref = None
        if samples:
            packed = pack([x.prompt_ids for x in samples], [x.response_ids for x in samples])
            lengths = [int(v) for v in packed[1].sum(dim=1)]
            adv = torch.tensor([x.advantage for x in samples], dtype=torch.float32)
            rows = torch.zeros(packed[3].shape, dtype=torch.float32)
        first = [i for i, pos in enumerate(positions) if pos % st.k == 0]
        later = [i for i, pos in enumerate(positions) if pos % st.k != 0]
        self._no_grad_logprobs(self.model, later, packed, lengths, rows, comm)
        for i in later:
            assert rows is not None
            st.old[positions[i]] = rows[i, : lengths[i] - 1].clone()
        if self.ref is not None:
            if samples:
                rows = torch.zeros(packed[3].shape, dtype=torch.float32)
            self._no_grad_logprobs(self.ref, list(range(len(samples))), packed, lengths, rows,
                                   comm)
            for i in range(len(samples)):
                assert rows is not None
                st.ref[positions[i]] = rows[i, : lengths[i] - 1].clone()
            if samples:
                ref = torch.zeros(packed[3].shape, dtype=torch.float32)
                for i in first:
                    ref[i, : lengths[i] - 1] = st.ref[positions[i]]
        one = torch.ones((), dtype=torch.float32)
        sums = self._passes(0, first, packed, lengths, None, ref, adv, one, comm)
        st.loss_sum += sums[0]
        st.kl_sum += sums[1]
        st.clipped += sums[2]
        st.tokens += sums[3]
        st.passes += int(sums[4])
        st.busy_s += time.perf_counter() - t0

    def stream_finish(self, samples: Sequence[Sample], shard: Shard | None = None,
                      mini_batches: int | None = None) -> dict[str, float]:
        """Completes the streamed step on the whole batch ``samples`` (this rank's, with
        ``shard``), which must be what was streamed, position for position; anything else
        (a sample missing or different, a batch smaller than the mini-batches, no stream) takes
        the step whole instead, so the update is always :meth:`train_step`'s. The stats add
        ``streamed`` (samples whose passes ran before this call) and ``stream_s`` (seconds
        those passes took)."""
        st, self._stream = self._stream, None
        n = shard.total if shard is not None else len(samples)
        positions = list(shard.positions) if shard is not None else list(range(len(samples)))
        asked = self._k(mini_batches)
        k = max(1, min(asked, n))
        why = None
        if st is None:
            why = "no step was streamed"
        elif st.broken is not None:
            why = st.broken
        elif n == 0 or k != st.k:
            why = f"{n} samples for {st.k} mini-batches"
        elif len(positions) != len(samples) or set(st.samples) != set(positions) or any(
                st.samples[pos] != smp for pos, smp in zip(positions, samples, strict=True)):
            why = "the batch is not the one streamed"
        if shard is not None:  # the ranks take the step alike, streamed or whole
            bad = shard.all_reduce(torch.tensor(0.0 if why is None else 1.0), op="max")
            if why is None and float(bad) > 0:
                why = "another rank's stream was refused"
        if why is not None:
            self.opt.zero_grad(set_to_none=True)
            stats = self.train_step(samples, shard, asked)
            stats.update(streamed=0.0, stream_s=0.0)
            if st is not None and n > 0:
                stats["stream_refused"] = 1.0
            return stats
        assert st is not None
        self.model.train()
        chunks = [[i for i, g in enumerate(positions) if g % k == j] for j in range(k)]
        packed: Any = None
        lengths: list[int] = []
        adv = old = ref = None
        if samples:  # a rank's shard may be empty (fewer samples than ranks)
            packed = pack([x.prompt_ids for x in samples], [x.response_ids for x in samples])
            lengths = [int(v) for v in packed[1].sum(dim=1)]
            adv = torch.tensor([x.advantage for x in samples], dtype=torch.float32)
            old = torch.zeros(packed[3].shape, dtype=torch.float32)
            for i, pos in enumerate(positions):
                if pos in st.old:
                    old[i, : lengths[i] - 1] = st.old[pos]
            if self.ref is not None:
                ref = torch.zeros(packed[3].shape, dtype=torch.float32)
                for i, pos in enumerate(positions):
                    ref[i, : lengths[i] - 1] = st.ref[pos]
        stats = {"loss": 0.0, "clipfrac": 0.0, "kl": 0.0, "micro_batches": 0.0}
        # the first mini-batch: its gradients were summed as its samples came; now divided by
        # its count, as its losses would have been
        denom = self._denominator(chunks[0], packed, shard)
        for prm in self.model.parameters():
            if prm.grad is not None:
                prm.grad.div_(denom.to(prm.grad.device))
        d = float(denom)
        self._update(n, shard)
        self._add_stats(stats, [st.loss_sum / d, st.kl_sum / d, st.clipped, st.tokens,
                                float(st.passes)], k)
        for j in range(1, k):
            denom = self._denominator(chunks[j], packed, shard)
            self.opt.zero_grad(set_to_none=True)
            sums = self._passes(j, chunks[j], packed, lengths, old, ref, adv, denom, shard)
            self._update(n, shard)
            self._add_stats(stats, sums, k)
        stats.update(samples=float(n), updates=float(k), streamed=float(len(st.samples)),
                     stream_s=st.busy_s)
        return stats

    def _no_grad_logprobs(self, model: Any, idx: list[int], packed: Any, lengths: list[int],
                          out: torch.Tensor | None, shard: Shard | None) -> None:
        """``model``'s log-probs of samples ``idx`` into ``out``, micro-batch by micro-batch
        without a graph (a sharded rank with none left makes the dummy pass)."""
        with torch.no_grad():
            for mb in self._even(self._micro_batches(idx, lengths), shard):
                if not mb:
                    self._dummy_pass(model, backward=False)
                    continue
                assert packed is not None and out is not None
                sel = torch.tensor(mb, dtype=torch.long)
                with self._autocast():
                    lp = self._logprobs(model, packed, sel)
                out[sel, : lp.shape[1]] = lp

    def _logprobs_grad(self, packed: Any, sel: torch.Tensor) -> torch.Tensor:
        """:meth:`_logprobs` of the policy with the graph kept (on the learner's device)."""
        ids, attn, pos, tgt, _ = packed
        w = int(attn[sel].sum(dim=1).max())
        dev = self._device()
        return sequence_logprobs(self.model, ids[sel, :w].to(dev), attn[sel, :w].to(dev),
                                 pos[sel, :w].to(dev), tgt[sel, : w - 1].to(dev),
                                 self.cfg.temperature).float()

    def _set_lr(self, n: int) -> None:
        lr = self.cfg.learning_rate
        if self.cfg.reference_samples > 0:
            lr *= min(1.0, n / self.cfg.reference_samples) ** 0.5
        if self.cfg.warmup_updates > 0:
            lr *= min(1.0, (self.updates + 1) / self.cfg.warmup_updates)
        for group in self.opt.param_groups:
            group["lr"] = lr

    def weights_bytes(self) -> bytes:
        """The policy's state dict as ``torch.save`` bytes (what the engines load in place)."""
        return state_bytes(self.model)

    def publish(self) -> tuple[bytes, str]:
        """The policy's weights as the engines load them, and their policy version."""
        sd = self.published_state()
        return weights.to_bytes(sd), weights.fingerprint(sd.items())

    def published_state(self) -> dict[str, torch.Tensor]:
        """The policy's state dict on CPU in the engines' dtype (``cfg.publish_dtype``)."""
        sd = weights.cpu_state(self.model)
        if self.cfg.publish_dtype:  # the engines' dtype: what they will hold
            dt = getattr(torch, self.cfg.publish_dtype)
            sd = {k: v.to(dt) if v.is_floating_point() else v for k, v in sd.items()}
        return sd

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "updates": self.updates}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["opt"])
        self.updates = int(sd.get("updates", 0))


def state_bytes(model: Any) -> bytes:
    return weights.to_bytes(weights.cpu_state(model))
