"""The pod entrypoint: ``python -m rlpacer_trainer.pod`` (the image's ENTRYPOINT).

Reads the env the operator sets (names in :mod:`rlpacer.api.contract`, re-exported by
:mod:`rlpacer_trainer.contract`) and plays the pod's role:

* ``driver``  loads the run config (the RLTrainingJob manifest at ``RLPACER_CONFIG``), joins
  Ray at ``RAY_ADDRESS`` through a Ray node of its own (or starts Ray locally when unset; see
  :mod:`rlpacer_trainer.topology` for why and how), resumes from the latest checkpoint
  in ``RLPACER_CHECKPOINT_DIR`` whose step the job's plan can take (at most the plan's step:
  a new attempt may restart behind the operator's controller, never ahead of it; with none,
  from step 0), and runs the loop, reporting each step to
  ``RLPACER_REPORT_URL`` with the token in ``RLPACER_TOKEN_FILE`` (in-process controller when
  no URL is set; an ``https://`` URL is verified with the CA in ``RLPACER_REPORT_CA_FILE``,
  and the endpoint is reached once before the engines start). Exit 0 when the job's steps
  are done, non-zero on failure (3: the operator refused the driver or its certificate did
  not verify): the operator then starts a new attempt (``RLPACER_ATTEMPT``) from the last
  checkpoint. Bad data (``spec.data``) exits with ``EXIT_DATA_INVALID`` (4) before anything
  heavy starts, its message last on stderr: the operator fails the job (reason DataInvalid)
  without a retry. A learner whose estimated memory per rank exceeds a rank's
  (:mod:`rlpacer_trainer.fit`: checked here before the engines start when the learner runs on
  this host or ``RLPACER_LEARNER_MEMORY_BYTES`` is set, and by each learner rank before it
  loads the model) exits with ``EXIT_LEARNER_DOES_NOT_FIT`` (5), the numbers and the fixes
  last on stderr: the operator fails the job (reason LearnerDoesNotFit) without a retry.
* ``head``    ``ray start --head --block`` bound to the pod's IP (``RLPACER_POD_IP``).
* ``rollout`` / ``learner``  ``ray start --address=$RAY_ADDRESS --block``: they contribute
  resources on which the driver places its engine actors and learners, and advertise their
  role and index (``rlpacer.io/<role>-<i>`` resource, ``rlpacer.io/role``/``rank`` labels)
  so an actor can be placed on exactly one pod (:mod:`rlpacer_trainer.topology`).

Ray's token auth: every role passes ``RAY_AUTH_TOKEN``/``RAY_AUTH_TOKEN_PATH`` through and
sets ``RAY_AUTH_MODE=token`` when a token is given (:func:`topology.ray_env`).

Runnable as a plain local process (tests play KWOK pods this way).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from rlpacer_trainer import contract as c
from rlpacer_trainer import topology

if TYPE_CHECKING:
    from rlpacer_trainer.config import RunConfig
    from rlpacer_trainer.controller_client import HTTPController


class PodEnvError(RuntimeError):
    pass


def _need(env: Mapping[str, str], name: str) -> str:
    v = env.get(name)
    if not v:
        raise PodEnvError(f"environment variable {name} is required for this role")
    return v


def run_driver(env: Mapping[str, str]) -> int:
    from rlpacer_trainer import runtime
    from rlpacer_trainer.config import RunConfig
    from rlpacer_trainer.controller_client import HTTPController

    cfg_path = Path(env.get(c.ENV_CONFIG) or c.CONFIG_PATH)
    ckpt = Path(env.get(c.ENV_CHECKPOINT_DIR) or c.CHECKPOINT_DIR)
    attempt = int(env.get(c.ENV_ATTEMPT, "0"))
    # the job as the API server holds it: admitted under its own version's rules
    cfg = RunConfig.load(cfg_path, out_dir=ckpt, stored=True)
    from rlpacer_trainer import fit

    # the learner's memory per rank, before any engine starts (where the driver can know it;
    # each learner rank checks itself too)
    fit.check_run(cfg, local=not env.get(c.ENV_RAY_ADDRESS), env=env)
    controller = None
    url = env.get(c.ENV_REPORT_URL)
    if url:
        token_file = Path(env.get(c.ENV_TOKEN_FILE) or c.TOKEN_PATH)
        retries = env.get(c.ENV_REPORT_RETRIES, "8")
        if not retries.isdigit():
            raise PodEnvError(f"{c.ENV_REPORT_RETRIES}={retries!r}: give a count of retries"
                              " (0 or more)")
        controller = HTTPController(url, _need(env, c.ENV_NAMESPACE), _need(env, c.ENV_JOB),
                                    token_file.read_text().strip(), retries=int(retries),
                                    ca_file=env.get(c.ENV_REPORT_CA_FILE) or None)
        # Reach the operator before anything heavy starts: a wrong CA, token or URL fails
        # the pod in seconds, not after the engines have loaded the model.
        controller.plan()
    if env.get(c.ENV_RAY_ADDRESS):
        # a separate host: attach through a Ray node of this pod (topology's docstring)
        with topology.attached(env, runtime_env=runtime.RUNTIME_ENV):
            runtime.wait_for_pods(cfg)  # then every engine and learner goes to its own pod
            return _run_loop(cfg, ckpt, attempt, controller)
    runtime.init_ray()
    return _run_loop(cfg, ckpt, attempt, controller)


def _run_loop(cfg: RunConfig, ckpt: Path, attempt: int,
              controller: HTTPController | None) -> int:
    from rlpacer_trainer import runtime

    engines, learners, up = runtime.start_job(cfg)
    print(f"started: rollout engines in {up['engines']:.1f} s, learners in"
          f" {up['learners']:.1f} s (together)", flush=True)
    from rlpacer_trainer.report import MetricsWriter

    ckpt.mkdir(parents=True, exist_ok=True)
    metrics = MetricsWriter(ckpt / f"metrics-attempt{attempt}.jsonl")

    def on_step(rec: dict[str, object]) -> None:
        metrics.write(rec)
        print(f"step {rec['step']} G={rec['group_size']} {rec['round_kind']}"
              f" reward={rec['reward']:.3f}{served_by(rec)}", flush=True)

    drv = runtime.build_driver(cfg, engines, controller=controller, attempt=attempt,
                               learners=learners,
                               engine_factory=lambda r: runtime.start_engine(cfg, r),
                               offered_replicas=runtime.offered_rollout_replicas,
                               checkpoint_dir=ckpt, on_step=on_step)
    # Where to resume is the job's plan's to say, not the checkpoint's: the operator's
    # controller takes a new attempt from any step up to its own (the plan's), none past it.
    at_most = None if controller is None else controller.plan().step
    if drv.load_checkpoint(at_most=at_most):
        print(f"resumed from checkpoint at step {drv.step} (attempt {attempt})", flush=True)
    elif at_most is not None:
        print(f"no checkpoint to resume from: attempt {attempt} starts at step 0 (the job's"
              f" plan is at step {at_most})", flush=True)
    (ckpt / f"topology-attempt{attempt}.json").write_text(json.dumps(drv.topology(), indent=1))
    drv.record_trace(ckpt / f"trace-attempt{attempt}.jsonl")  # every response (rlpacer.api.trace)
    drv.run()
    final = drv.save_checkpoint()
    # what this pod's checkpoint folder holds: the learner's part (its state and model/) comes
    # through Ray when the learner's pod cannot see this folder (no shared claim)
    print(f"checkpoint {final.name} in {ckpt}: "
          f"{', '.join(sorted(p.name for p in final.iterdir()))}", flush=True)
    metrics.close()
    drv.close()
    cal = drv.prior.calibration()
    seen = cal["seen"]
    if seen["responses"]:
        print(f"length prior: {seen['below_p10']:.2f}/{seen['below_p50']:.2f}/"
              f"{seen['below_p90']:.2f} of responses at or below the predicted p10/p50/p90"
              f" (prompts seen before, {seen['responses']} responses);"
              f" {drv.routed_total} prompts routed to long rounds", flush=True)
    print(f"done: {drv.step} steps", flush=True)
    return 0


def served_by(rec: Mapping[str, object]) -> str:
    """`` served by replica 0 on <host> (<n> responses), ...``: which engine generated a step's
    responses, on which host (read inside the engine's process), for the driver's log."""
    engines = rec.get("engines")
    if not isinstance(engines, list) or not engines:
        return ""
    parts = [f"replica {e.get('replica')} on {e.get('hostname', '?')} ({e.get('responses', 0)}"
             f" responses{', died' if e.get('died') else ''})" for e in engines]
    return " served by " + ", ".join(parts)


def ray_command(role: str, env: Mapping[str, str]) -> list[str]:
    if role != c.Role.HEAD:
        _need(env, c.ENV_RAY_ADDRESS)
    return topology.ray_start_command(role, env)


class Terminated(SystemExit):
    """SIGTERM (the kubelet stopping the pod): unwind and exit 143 (128 + SIGTERM)."""


def _on_sigterm(signum: int, _frame: object) -> None:
    raise Terminated(128 + signum)


def _run_node(role: str, env: Mapping[str, str]) -> int:
    """``ray start --block`` for this pod; SIGTERM stops it (and what it started) first."""
    from rlpacer_trainer.podlog import ENV_POD_LOG, own_stdout

    # the actors Ray places here write their progress to this pod's log (podlog's docstring)
    proc = subprocess.Popen(ray_command(role, env),
                            env=topology.ray_env({**env, ENV_POD_LOG: own_stdout()}))
    try:
        return proc.wait()
    except Terminated:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise


def main(env: Mapping[str, str] | None = None) -> int:
    env = dict(os.environ if env is None else env)
    role = env.get(c.ENV_ROLE, c.Role.DRIVER.value)
    # A container's entrypoint is PID 1, which ignores SIGTERM unless it handles it: without
    # this a stopped pod would wait out its grace period and be killed without cleanup.
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if role == c.Role.DRIVER:
            return run_driver(env)
        if role in (c.Role.HEAD, c.Role.ROLLOUT, c.Role.LEARNER):
            return _run_node(role, env)
        raise PodEnvError(f"{c.ENV_ROLE}={role!r}: expected one of {[r.value for r in c.Role]}")
    except (PodEnvError, topology.TopologyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        from rlpacer_trainer.config import ConfigError, DataInvalid
        from rlpacer_trainer.controller_client import ControllerError, ReportTLSError

        if isinstance(err, DataInvalid):  # permanent: the operator fails the job, no retry
            print(f"error: data invalid: {err}", file=sys.stderr)
            return c.EXIT_DATA_INVALID
        if isinstance(err, ConfigError):  # the run config: the job's spec, named
            print(f"error: {err}", file=sys.stderr)
            return 2
        if isinstance(err, (ReportTLSError, ControllerError)):
            print(f"error: {err}", file=sys.stderr)
            return 3
        from rlpacer_trainer.fit import does_not_fit

        unfit = does_not_fit(err)  # the driver's check, or a learner rank's through Ray
        if unfit is not None:  # permanent: the operator fails the job, no retry
            print(f"error: {unfit}", file=sys.stderr)
            return c.EXIT_LEARNER_DOES_NOT_FIT
        raise


if __name__ == "__main__":
    sys.exit(main())
