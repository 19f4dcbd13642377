"""``rlpacer bench-train``'s ``trl<N>`` arm: TRL's ``GRPOTrainer`` on the same job.

The arm trains the manifest's model from the same warm start on the same training prompts,
reward, learning rate, sampling temperature, response cap and prompts per step as the other
arms, with ``N`` responses per prompt, the way a user of TRL would run it on one machine: one
process, transformers' ``generate`` for the rollout, one optimizer step per step (TRL's
default: no old-log-prob pass). Its held-out accuracy is measured by the same code as every
other arm's: its weights are loaded into the same vLLM engines and scored greedily by the job's
own reward (:meth:`Driver.evaluate`), with the clock stopped.

Matched to the job's algorithm (``algos``, the preset with the manifest's overrides): the loss
aggregation (``SequenceMeanTokenMean`` is TRL's ``loss_type="grpo"``, ``TokenMean`` its
``"dapo"``), the clip range on each side, the KL coefficient, the group-std advantage, AdamW
with no weight decay, gradient norm clipped at 1.0, a linear warm-up over the same steps then
a constant rate. A truncated response scores 0.0, as in the driver. Not matched, as TRL has
neither: dynamic sampling (groups without reward variance stay in TRL's batch, with advantage
0) and overlong shaping (``bench-train`` refuses a job that has it). TRL is an optional
dependency (``pip install rlpacer[trl]``); the model must be a Hugging Face-format folder
(the builtin tiny model is one, its prompts given to TRL as ``<s>`` + characters); the
prompts' token ids are checked to be the engines'.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

#: TRL's version the arm was written and measured against (``rlpacer[trl]`` pins it)
TRL_VERSION = "1.16.0"
#: completions per forward/backward micro-batch (memory only: one optimizer step per step)
MICRO_BATCH = 64
#: the job's loss aggregation -> TRL's loss_type of the same normalization
LOSS_TYPE = {"SequenceMeanTokenMean": "grpo",  # each response's token mean, then the mean
             "TokenMean": "dapo"}  # every token of the step's batch alike


def parse(name: str) -> int | None:
    """``trl<N>`` -> N (responses per prompt); None for any other arm's name."""
    if name.startswith("trl") and name[3:].isdigit() and int(name[3:]) >= 2:
        return int(name[3:])
    if name.startswith("trl"):
        raise ValueError(f"unknown arm {name!r}: use trl<N> with N >= 2 (TRL's GRPOTrainer at"
                         " N responses per prompt)")
    return None


def check(cfg: Any) -> None:
    """Raises ``ValueError`` naming what to change if the arm cannot run ``cfg``."""
    if cfg.overlong_buffer:
        raise ValueError("the trl<N> arm cannot match overlong reward shaping (TRL has none):"
                         " set spec.algorithm.overlongPenalty.enabled: false to compare")
    if not (cfg.model_path / "config.json").is_file():
        raise ValueError(f"the trl<N> arm needs a Hugging Face-format model folder in"
                         f" spec.model.source (got {cfg.spec.model.source!r}, no config.json):"
                         " TRL loads it with transformers")
    try:
        import trl
    except ImportError as err:
        raise ValueError("the trl<N> arm needs TRL: pip install 'rlpacer[trl]'"
                         f" (trl=={TRL_VERSION})") from err
    if trl.__version__ != TRL_VERSION:
        print(f"note: trl {trl.__version__} installed; the arm was measured with {TRL_VERSION}")


def run(cfg: Any, drv: Any, evalset: Sequence[Any], *, group_size: int, steps: int,
        eval_every: int, budget: float | None, start_accuracy: float,
        out_dir: Any, label: str) -> dict[str, Any]:
    """Trains ``cfg``'s job with TRL at ``group_size`` for ``steps`` steps (or until its
    training wall clock reaches ``budget``), evaluating every ``eval_every`` steps on
    ``evalset`` through ``drv`` (its engines get the arm's weights). Returns the curve (points
    as :mod:`tta` reads them), ``train_s``, ``eval_s``, ``steps``, ``tokens`` (completion tokens
    generated) and the seconds TRL spent generating (``rollout_s``)."""
    import warnings

    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    with warnings.catch_warnings():  # its vLLM integration (unused here) warns of versions
        warnings.simplefilter("ignore", UserWarning)
        import trl
        from trl.trainer.grpo_config import GRPOConfig
        from trl.trainer.grpo_trainer import GRPOTrainer

    from rlpacer_trainer import models, weights
    from rlpacer_trainer.rewards import RewardCall

    start_policy = drv.policy_version  # the warm start's, as the engines hold it
    tok = cfg.tokenizer()
    problems = cfg.problems()
    system = cfg.spec.data.system_prompt
    hf = AutoTokenizer.from_pretrained(str(cfg.model_path), local_files_only=True)

    def prompt(p: Any) -> Any:
        """What TRL tokenizes into the ids the engines get (``tok.prompt_ids``)."""
        if isinstance(tok, models.CharTokenizer):  # the builtin model: <s> + characters
            return f"{hf.bos_token}{p.prompt}"
        if isinstance(tok, models.HFTokenizer) and tok.chat:  # TRL applies the template
            msgs = [{"role": "user", "content": p.prompt}]
            if system is not None:
                msgs.insert(0, {"role": "system", "content": system})
            return msgs
        return p.prompt if system is None else f"{system}\n\n{p.prompt}"

    for p in problems[:8]:  # the same prompt ids as the other arms, or no comparison
        want = tok.prompt_ids(p.prompt)
        got = prompt(p)
        have = (hf.apply_chat_template(got, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]
                if isinstance(got, list) else hf(got)["input_ids"])
        if list(have) != list(want):
            raise ValueError(f"TRL would tokenize prompt {p.pid} as {list(have)[:16]}..., the"
                             f" engines get {want[:16]}...: not the same job")
    data = datasets.Dataset.from_list([{"prompt": prompt(p), "pid": i}
                                       for i, p in enumerate(problems)])
    eos = tok.eos_ids
    scorer = drv.scorer
    generated = [0]

    def reward(prompts: Any, completions: Any, completion_ids: Sequence[Sequence[int]],
               pid: Sequence[int], **_: Any) -> list[float]:
        out = [0.0] * len(completion_ids)
        for k, (ids, i) in enumerate(zip(completion_ids, pid, strict=True)):
            generated[0] += len(ids)
            if ids and ids[-1] in eos:  # finished; a truncated response scores 0.0
                scorer.submit(k, RewardCall.of(tok.decode(ids), problems[int(i)]))
        scores, _ = scorer.collect()
        for k, v in scores.items():
            out[int(k)] = float(v)
        return out

    per_step = int(cfg.spec.prompts_per_step) * group_size
    micro = math.gcd(per_step, MICRO_BATCH)
    lc = cfg.learner_config()
    lr = float(lc.learning_rate)
    loss_type = LOSS_TYPE[str(lc.aggregation)]
    # the learner warms up over `warmup_updates` optimizer updates, `mini_batches` a step:
    # the same steps here, at one update a step, by the learner's rule (the first not at 0)
    warmup_steps = max(1, math.ceil(cfg.warmup_updates / max(1, int(cfg.mini_batches))))
    args = GRPOConfig(
        output_dir=str(out_dir), report_to="none", save_strategy="no",
        logging_strategy="no", use_cpu=True, bf16=False, seed=int(cfg.data_seed),
        data_seed=int(cfg.data_seed), learning_rate=lr,
        weight_decay=0.0, max_grad_norm=1.0, max_steps=steps,
        per_device_train_batch_size=micro, gradient_accumulation_steps=per_step // micro,
        num_generations=group_size, max_completion_length=int(cfg.max_tokens),
        temperature=float(cfg.temperature), top_p=float(cfg.top_p), top_k=0,
        loss_type=loss_type, scale_rewards="group", beta=float(lc.kl_coef),
        num_iterations=1, epsilon=float(lc.clip_low), epsilon_high=float(lc.clip_high),
        disable_dropout=True,
        dataloader_num_workers=0, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(str(cfg.model_path), dtype=torch.float32,
                                                 local_files_only=True)
    publish = getattr(torch, cfg.engine_dtype) if cfg.engine_dtype else None
    curve: list[dict[str, Any]] = [{"train_s": 0.0, "step": 0, "accuracy": start_accuracy}]
    clock = {"t0": 0.0, "eval_s": 0.0, "train_s": 0.0}

    class Evaluate(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock["t0"] = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            train_s = time.perf_counter() - clock["t0"] - clock["eval_s"]
            clock["train_s"] = train_s
            last = state.global_step >= steps
            over = budget is not None and train_s >= budget
            if state.global_step % eval_every and not (last or over):
                return
            t0 = time.perf_counter()
            sd = weights.cpu_state(kw["model"])
            if publish is not None:
                sd = {k: v.to(publish) if v.is_floating_point() else v for k, v in sd.items()}
            version = weights.fingerprint(sd.items())
            drv.push_policy(weights.to_bytes(sd), version)
            acc = drv.evaluate(evalset)
            curve.append({"train_s": train_s, "step": state.global_step, "accuracy": acc,
                          "policy": version})
            print(f"{label}: step {state.global_step} train {train_s:.1f} s"
                  f" accuracy {acc:.3f}", flush=True)
            clock["eval_s"] += time.perf_counter() - t0
            if over:
                control.should_training_stop = True

    gen_s = [0.0]

    class Trainer(GRPOTrainer):  # type: ignore[misc]
        def _generate_single_turn(self, *a: Any, **k: Any) -> Any:  # TRL's rollout
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **k)  # type: ignore[no-untyped-call]
            finally:
                gen_s[0] += time.perf_counter() - t0

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / warmup_steps))
    trainer = Trainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                      processing_class=hf, callbacks=[Evaluate()],
                      optimizers=(opt, sched))
    trainer.train()
    rollout_s = gen_s[0]
    return {"curve": curve, "start_policy": start_policy,
            "train_s": clock["train_s"], "eval_s": clock["eval_s"],
            "steps": int(trainer.state.global_step), "tokens": generated[0],
            "rollout_s": rollout_s, "trl_version": trl.__version__}
