"""rlpacer: fast synchronous on-policy LLM RL post-training on Kubernetes.

Layers (enforced by import-linter, see pyproject.toml):
    rlpacer.api      shared types (RLTrainingJob spec/status, step-report protocol, run config)
    rlpacer.control  pure decision logic (SAGC, tail batching, per-job plan), no I/O
    rlpacer.operator Kopf handlers, builders, scaler, step-report endpoint, metrics
    rlpacer.sim      trace-driven rollout simulator and benchmark harness
    rlpacer.testing  test harness: a real local control plane, played hosts (above the operator)
    rlpacer.bench    benchmarks of the control plane (bench-operator, bench-scale, ...)
    rlpacer.devcluster  ``rlpacer dev-cluster`` (bench and devcluster sit on the test harness)
"""

__version__ = "0.1.0"
