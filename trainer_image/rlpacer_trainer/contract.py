"""The pod contract as the trainer sees it: env names, mount paths, the entrypoint module.

The single definition lives in :mod:`rlpacer.api.contract` (the operator's builders import it
too); this module re-exports what the trainer reads so both sides cannot drift.
"""

from __future__ import annotations

from rlpacer.api.contract import (
    ALL_ENV,
    CHECKPOINT_DIR,
    CONFIG_PATH,
    ENV_ATTEMPT,
    ENV_CHECKPOINT_DIR,
    ENV_CONFIG,
    ENV_JOB,
    ENV_NAMESPACE,
    ENV_POD_IP,
    ENV_RANK,
    ENV_RAY_ADDRESS,
    ENV_RAY_AUTH_MODE,
    ENV_RAY_AUTH_TOKEN_PATH,
    ENV_RAY_TEMP_DIR,
    ENV_REPORT_CA_FILE,
    ENV_REPORT_RETRIES,
    ENV_REPORT_URL,
    ENV_ROLE,
    ENV_TOKEN_FILE,
    ENV_WORLD_SIZE,
    EXIT_DATA_INVALID,
    POD_ENTRYPOINT_MODULE,
    RAY_AUTH_MODE_TOKEN,
    RAY_CLIENT_PORT,
    RAY_GCS_PORT,
    RAY_TOKEN_PATH,
    TOKEN_PATH,
    Role,
)

__all__ = [
    "ALL_ENV",
    "CHECKPOINT_DIR",
    "CONFIG_PATH",
    "ENV_ATTEMPT",
    "ENV_CHECKPOINT_DIR",
    "ENV_CONFIG",
    "ENV_JOB",
    "ENV_NAMESPACE",
    "ENV_POD_IP",
    "ENV_RANK",
    "ENV_RAY_ADDRESS",
    "ENV_RAY_AUTH_MODE",
    "ENV_RAY_AUTH_TOKEN_PATH",
    "ENV_RAY_TEMP_DIR",
    "ENV_REPORT_CA_FILE",
    "ENV_REPORT_RETRIES",
    "ENV_REPORT_URL",
    "ENV_ROLE",
    "ENV_TOKEN_FILE",
    "ENV_WORLD_SIZE",
    "EXIT_DATA_INVALID",
    "POD_ENTRYPOINT_MODULE",
    "RAY_AUTH_MODE_TOKEN",
    "RAY_CLIENT_PORT",
    "RAY_GCS_PORT",
    "RAY_TOKEN_PATH",
    "TOKEN_PATH",
    "Role",
]
