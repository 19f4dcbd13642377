"""The rlpacer operator: Kopf watches, pure decisions, one status-write path, step reports.

Module map (pure modules have no I/O and are unit-tested directly):

* ``settings``   OperatorSettings: one documented config object (env ``RLPACER_OPERATOR_*``
                 and ``rlpacer operator --flags``).
* ``names``      child names and labels valid for any 63-character job name (pure).
* ``builders``   children as plain dicts: ConfigMap, token Secret, Services, Ray head /
                 learner / rollout StatefulSets, driver Pod per attempt (pure).
* ``decide``     the reconcile decision: admission, suspend/resume, driver failure ->
                 new attempt or Failed, activeDeadlineSeconds, TTL, rollout readiness (pure).
* ``scaler``     long-round capacity state machine: Ready / ScalingUp / TimedOut (pure).
* ``hosting``    hosts ``rlpacer.control.plan.JobController`` with its state as a canonical
                 JSON string (bit-exact round trip) (pure).
* ``reports``    folds a step report into the status; ``GET plan`` (pure).
* ``enforce``    run-time policy: clamps (Enforce), the SLOViolated condition, policy notes
                 and their Events (pure).
* ``policies``   a namespace's RLTrainingPolicies for the report path (TTL cache).
* ``runtime``    per-job runtime: the only status writer (PUT /status with a resourceVersion
                 precondition, re-run on 409), token, Events, observe + apply children.
* ``server``     aiohttp: the step-report endpoint and /metrics, /healthz, /readyz.
* ``handlers``   Kopf handlers (thin) and the per-job reconcile loops; admission webhooks
                 (``admission``) register on the same registry when enabled.
* ``lease``      leader election with a coordination.k8s.io Lease.
* ``metrics``    Prometheus metrics with (namespace, job) labels, removed on deletion.
* ``main``       ``rlpacer operator``: servers, Lease, then Kopf, in one event loop.
* ``kube``       a small asyncio Kubernetes client for the operator's own writes.
* ``commands``   registers ``rlpacer crds`` and ``rlpacer operator``.

Its benchmarks (``rlpacer bench-operator``, ``bench-scale``) live in ``rlpacer.bench``, above it:
the operator imports neither them nor the test harness (``rlpacer.testing``).
"""
