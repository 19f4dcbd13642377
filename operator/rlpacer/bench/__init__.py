"""Benchmarks of the control plane, as ``rlpacer`` sub-commands (developer tools).

* ``reports``     ``rlpacer bench-operator``: step-report round trip under load.
* ``scale``       ``rlpacer bench-scale``: the operator's cost as the number of jobs grows.
* ``long_round``  ``rlpacer bench-long-round``: a long round on 1 and on 2 rollout replicas.
* ``commands``    registers ``bench-operator`` and ``bench-scale`` (``long_round`` registers
                  its own).

They start the test harness's local control plane (``rlpacer.testing``) and the operator as a
process of its own; the operator never imports them (import-linter, see pyproject.toml).
"""
