"""Progress lines into a pod's own log, from the Ray actors that do its work.

A pod of the head, learner or rollout role runs ``ray start --block``: the engines and learners
placed on it run in Ray's worker processes, whose output goes to Ray's log files inside the pod,
not to the pod's log. The pod's entrypoint therefore names its own standard output in
:data:`ENV_POD_LOG` (``/proc/<its pid>/fd/1``; PID 1 in a container); ``ray start``, its
raylet and the workers inherit it, and :func:`pod_log` writes there. So ``kubectl logs`` of a
rollout pod shows what its engine generated, and of a learner pod each update it made. Outside a
pod (``rlpacer run``, the driver's own process) nothing is set and nothing is written.
"""

from __future__ import annotations

import os
import time

#: The file a pod's actors write their progress lines to (set by the pod's entrypoint).
ENV_POD_LOG = "RLPACER_POD_LOG"


def own_stdout() -> str:
    """What :data:`ENV_POD_LOG` is set to by a pod's entrypoint: its own standard output."""
    return f"/proc/{os.getpid()}/fd/1"


def pod_log(line: str) -> None:
    """Append ``line`` (timestamped) to the pod's log; a no-op outside a pod, and never an
    error: a log line must not fail the work it describes."""
    path = os.environ.get(ENV_POD_LOG)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
    except OSError:
        pass
