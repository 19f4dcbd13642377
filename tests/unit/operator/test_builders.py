"""Builders: names valid for any job name, owner references, the pod contract, idempotence."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from rlpacer.api import contract, sources
from rlpacer.api.job import load_manifest, parse_spec
from rlpacer.operator import builders, names

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

job_names = hs.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z", fullmatch=True)


def _inputs(name: str = "demo", **kw: object) -> builders.BuildInputs:
    spec = load_manifest(ROOT / "examples" / "rltrainingjob.yaml").spec
    args: dict[str, object] = dict(
        name=name,
        namespace="team",
        uid="u-1",
        spec=spec,
        attempt=2,
        rollout_replicas=3,
        report_url="http://op.sys.svc:8080",
    )
    args.update(kw)
    return builders.BuildInputs(**args)  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(job_names)
def test_child_names_valid_for_any_job_name(job: str) -> None:
    for role in contract.Role:
        sts = names.statefulset(job, role)
        assert len(sts) <= names.STATEFULSET_NAME and DNS1123.match(sts), sts
    for svc in (names.head_service(job), names.workers_service(job)):
        assert len(svc) <= 63 and DNS1035.match(svc), svc
    for other in (names.secret(job), names.ray_secret(job), names.config_map(job),
                  names.driver_pod(job, 1000), names.network_policy(job),
                  names.network_policy(job, contract.Role.DRIVER)):
        assert len(other) <= 63 and DNS1123.match(other), other
    for v in names.labels(job, contract.Role.DRIVER).values():
        assert len(v) <= 63 and LABEL_VALUE.match(v)


def test_long_names_are_distinct_and_stable() -> None:
    a, b = "a" * 62 + "x", "a" * 62 + "y"
    assert names.statefulset(a, contract.Role.ROLLOUT) != names.statefulset(
        b, contract.Role.ROLLOUT
    )
    assert names.head_service("7job") == "r7job-head"
    assert names.statefulset("short", contract.Role.ROLLOUT) == "short-rollout"


def test_children_have_owner_and_labels() -> None:
    children = builders.build_children(_inputs())
    kinds = sorted(c["kind"] for c in children)
    assert kinds == [
        "ConfigMap",
        "Pod",
        "Service",
        "Service",
        "StatefulSet",
        "StatefulSet",
        "StatefulSet",
    ]
    for c in children:
        ref = c["metadata"]["ownerReferences"][0]
        assert ref["uid"] == "u-1" and ref["controller"] and ref["kind"] == "RLTrainingJob"
        assert c["metadata"]["labels"][contract.LABEL_JOB] == "demo"
        assert c["metadata"]["namespace"] == "team"


def test_rollout_statefulset_and_gpus() -> None:
    children = {c["metadata"]["name"]: c for c in builders.build_children(_inputs())}
    sts = children["demo-rollout"]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"][contract.GPU_RESOURCE] == "2"
    assert builders.GPU_TOLERATION in pod["tolerations"]
    tpl_labels = sts["spec"]["template"]["metadata"]["labels"]
    # no per-pod queue label: the job is admitted through its own Workload
    assert contract.LABEL_KUEUE_QUEUE not in tpl_labels
    assert sts["spec"]["selector"]["matchLabels"].items() <= tpl_labels.items()
    learner = children["demo-learner"]["spec"]["template"]["spec"]["containers"][0]
    assert learner["resources"]["limits"][contract.GPU_RESOURCE] == "4"


def test_driver_pod_carries_the_contract() -> None:
    pod = next(c for c in builders.build_children(_inputs()) if c["kind"] == "Pod")
    assert pod["metadata"]["name"] == "demo-driver-2"
    assert pod["spec"]["restartPolicy"] == "Never"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env[contract.ENV_ATTEMPT] == "2"
    assert env[contract.ENV_ROLE] == "driver"
    assert env[contract.ENV_REPORT_URL] == "http://op.sys.svc:8080"
    assert env[contract.ENV_TOKEN_FILE] == contract.TOKEN_PATH
    assert env[contract.ENV_CONFIG] == contract.CONFIG_PATH
    assert env[contract.ENV_RAY_ADDRESS] == "demo-head.team.svc:6379"
    mounts = {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert {contract.CONFIG_MOUNT_DIR, contract.TOKEN_MOUNT_DIR, contract.CHECKPOINT_DIR} <= mounts
    assert set(env) <= set(contract.ALL_ENV)


@pytest.mark.parametrize("child", ["demo-head", "demo-learner", "demo-rollout", "demo-driver-2"])
def test_every_pod_gets_its_own_ip_and_its_index(child: str) -> None:
    """The pod's Ray node binds its own address (downward API status.podIP); the workers'
    index (their Ray placement resource) comes from the StatefulSet's pod-index label."""
    obj = next(c for c in builders.build_children(_inputs())
               if c["metadata"]["name"] == child and c["kind"] in ("StatefulSet", "Pod"))
    pod = obj["spec"]["template"]["spec"] if obj["kind"] == "StatefulSet" else obj["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env[contract.ENV_POD_IP]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    rank = env[contract.ENV_RANK]
    if child in ("demo-learner", "demo-rollout"):
        assert rank["valueFrom"]["fieldRef"]["fieldPath"] == (
            f"metadata.labels['{builders.POD_INDEX_LABEL}']")
    else:
        assert rank["value"] == "0"
    assert set(env) <= set(contract.ALL_ENV)


def _pod_of(child: str, inputs: builders.BuildInputs) -> tuple[dict, dict]:  # type: ignore[type-arg]
    """(pod metadata, pod spec) of a workload child: a StatefulSet's template or the driver."""
    obj = next(c for c in builders.build_children(inputs)
               if c["metadata"]["name"] == child and c["kind"] in ("StatefulSet", "Pod"))
    if obj["kind"] == "StatefulSet":
        return obj["spec"]["template"]["metadata"], obj["spec"]["template"]["spec"]
    return obj["metadata"], obj["spec"]


@pytest.mark.parametrize("child", ["demo-head", "demo-learner", "demo-rollout", "demo-driver-2"])
def test_every_pod_mounts_the_ray_token_and_only_the_driver_the_report_token(
    child: str,
) -> None:
    """Every Ray process of the job runs with token auth (the same token: one Secret for the
    job, mounted read-only); the step-report token reaches the driver alone."""
    meta, pod = _pod_of(child, _inputs(ray_token_sha256="ab" * 32))
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env[contract.ENV_RAY_AUTH_MODE] == "token" == contract.RAY_AUTH_MODE_TOKEN
    assert env[contract.ENV_RAY_AUTH_TOKEN_PATH] == contract.RAY_TOKEN_PATH
    assert contract.RAY_TOKEN_PATH.startswith(contract.RAY_TOKEN_MOUNT_DIR + "/")
    # Ray's own names, as the trainer reads them
    assert (contract.ENV_RAY_AUTH_MODE, contract.ENV_RAY_AUTH_TOKEN_PATH) == (
        "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    ray_mount = mounts[contract.RAY_TOKEN_MOUNT_DIR]
    assert ray_mount["readOnly"] is True
    assert vols[ray_mount["name"]]["secret"] == {
        "secretName": names.ray_secret("demo"), "defaultMode": 0o440}
    secrets_mounted = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    if child == "demo-driver-2":
        assert secrets_mounted == {names.secret("demo"), names.ray_secret("demo")}
        assert mounts[contract.TOKEN_MOUNT_DIR]["readOnly"] is True
        assert env[contract.ENV_TOKEN_FILE] == contract.TOKEN_PATH
    else:
        assert secrets_mounted == {names.ray_secret("demo")}
        assert contract.TOKEN_MOUNT_DIR not in mounts
        assert contract.ENV_TOKEN_FILE not in env and contract.ENV_REPORT_URL not in env
    assert set(env) <= set(contract.ALL_ENV)
    # the token's hash on every pod: a replaced token rolls the StatefulSets' pods
    assert meta["annotations"] == {contract.ANNOTATION_RAY_TOKEN_HASH: "ab" * 32}
    meta, _ = _pod_of(child, _inputs())
    assert "annotations" not in meta  # not known: nothing claimed


def test_ray_token_secret_is_its_own_immutable_secret() -> None:
    sec = builders.ray_token_secret(_inputs(), "tok")
    assert sec["metadata"]["name"] == names.ray_secret("demo") == "demo-ray-token"
    assert sec["metadata"]["name"] != names.secret("demo")
    assert sec["immutable"] is True and sec["data"] == {contract.RAY_TOKEN_KEY: "dG9r"}
    assert sec["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert sec["metadata"]["labels"][contract.LABEL_JOB] == "demo"
    # neither Secret is among the applied children (their content is minted once)
    kinds = {c["kind"] for c in builders.build_children(_inputs(ray_token_sha256="x"))}
    assert "Secret" not in kinds


def test_config_map_is_a_runnable_manifest() -> None:
    import yaml

    cm = next(c for c in builders.build_children(_inputs()) if c["kind"] == "ConfigMap")
    doc = yaml.safe_load(cm["data"][contract.CONFIG_KEY])
    assert doc["kind"] == "RLTrainingJob" and doc["metadata"]["name"] == "demo"
    assert parse_spec(doc["spec"]) == _inputs().spec


def test_suspended_or_finished_has_no_workloads_and_secret_is_separate() -> None:
    kinds = {c["kind"] for c in builders.build_children(_inputs(workloads=False))}
    assert kinds == {"ConfigMap", "Service"}
    sec = builders.token_secret(_inputs(), "tok")
    assert sec["immutable"] is True and sec["data"][contract.TOKEN_KEY] == "dG9r"


def test_pure_and_idempotent() -> None:
    assert builders.build_children(_inputs()) == builders.build_children(_inputs())


def _pod_specs(inputs: builders.BuildInputs) -> dict[str, dict[str, object]]:
    """role -> the pod spec the builders make for it (StatefulSet templates and the driver)."""
    out = {}
    for c in builders.build_children(inputs):
        if c["kind"] == "StatefulSet":
            out[c["spec"]["template"]["metadata"]["labels"][contract.LABEL_ROLE]] = (
                c["spec"]["template"]["spec"])
        elif c["kind"] == "Pod":
            out[c["metadata"]["labels"][contract.LABEL_ROLE]] = c["spec"]
    return out


@pytest.mark.parametrize("role", [r.value for r in contract.Role])
def test_every_pod_is_restricted(role: str) -> None:
    """Least privilege: no API token, the image's non-root user, no capabilities, no
    escalation, RuntimeDefault seccomp, a read-only root with writable emptyDirs where Ray,
    vLLM and torch write, and HOME/caches pointing into them."""
    pod = _pod_specs(_inputs())[role]
    assert pod["automountServiceAccountToken"] is False
    psc = pod["securityContext"]
    assert psc == {
        "runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
        "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"},
    }
    (c,) = pod["containers"]  # type: ignore[misc]
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "runAsUser" not in sc or sc["runAsUser"] != 0
    vols = {v["name"]: v for v in pod["volumes"]}  # type: ignore[attr-defined]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    for path in (contract.TMP_DIR, contract.HOME_DIR, contract.SHM_DIR):
        assert "emptyDir" in vols[mounts[path]["name"]], path
        assert not mounts[path].get("readOnly")
    assert vols[mounts[contract.SHM_DIR]["name"]]["emptyDir"]["medium"] == "Memory"
    # every writable place is a volume; every volume kind is one "restricted" allows
    allowed = {"configMap", "secret", "emptyDir", "persistentVolumeClaim", "projected",
               "downwardAPI", "csi", "ephemeral"}
    for v in vols.values():
        assert set(v) - {"name"} <= allowed, v
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env[contract.ENV_HOME] == contract.HOME_DIR
    assert env[contract.ENV_XDG_CACHE_HOME].startswith(contract.HOME_DIR + "/")
    writable = {contract.TMP_DIR, contract.HOME_DIR, contract.SHM_DIR}
    if role in ("driver", "learner"):
        assert not mounts[contract.CHECKPOINT_DIR].get("readOnly")
        writable.add(contract.CHECKPOINT_DIR)
    assert {p for p, m in mounts.items() if not m.get("readOnly")} == writable
    assert not any("hostPath" in v for v in vols.values())
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert key not in pod


def test_secrets_are_mounted_read_only_for_the_pod_user_alone() -> None:
    pods = _pod_specs(_inputs())
    driver = pods["driver"]
    (c,) = driver["containers"]  # type: ignore[misc]
    token = next(m for m in c["volumeMounts"] if m["mountPath"] == contract.TOKEN_MOUNT_DIR)
    assert token["readOnly"] is True
    secrets = [v for v in driver["volumes"] if "secret" in v]  # type: ignore[attr-defined]
    assert secrets and all(v["secret"]["defaultMode"] == 0o440 for v in secrets)
    assert contract.SECRET_FILE_MODE == 0o440
    # nobody else mounts the step-report token
    for role in ("head", "learner", "rollout"):
        assert not any(m["mountPath"] == contract.TOKEN_MOUNT_DIR
                       for m in pods[role]["containers"][0]["volumeMounts"])  # type: ignore[index]


def test_restriction_holds_with_a_claim_and_without_gpus() -> None:
    spec = _inputs().spec
    ckpt = spec.checkpoint.model_copy(update={"volume_claim": "ckpt"})
    pods = _pod_specs(_inputs(spec=spec.model_copy(update={"checkpoint": ckpt})))
    learner = pods["learner"]
    claim = next(v for v in learner["volumes"] if v["name"] == "checkpoints")  # type: ignore[attr-defined]
    assert claim["persistentVolumeClaim"] == {"claimName": "ckpt"}
    # fsGroup makes the claim group-writable for the pod's user
    assert learner["securityContext"]["fsGroup"] == contract.POD_GID  # type: ignore[index]
    built = builders.build_children(_inputs())
    builders.build_children(_inputs())  # the shared constants are never mutated by a build
    assert builders.POD_SECURITY_CONTEXT["runAsUser"] == 1000
    assert built == builders.build_children(_inputs())


def test_the_report_ca_reaches_the_driver_through_the_configmap() -> None:
    """With TLS the ConfigMap carries the operator's CA and only the driver (the one role that
    reports) is told where it is mounted; without it neither appears."""
    ca = "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n"
    children = builders.build_children(_inputs(report_ca=ca,
                                               report_url="https://op.sys.svc:8080"))
    cm = next(c for c in children if c["kind"] == "ConfigMap")
    assert cm["data"][contract.REPORT_CA_KEY] == ca
    assert f"{contract.CONFIG_MOUNT_DIR}/{contract.REPORT_CA_KEY}" == contract.REPORT_CA_PATH
    for c in children:
        if c["kind"] not in ("Pod", "StatefulSet"):
            continue
        spec = c["spec"] if c["kind"] == "Pod" else c["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert contract.CONFIG_MOUNT_DIR in mounts
        if c["kind"] == "Pod":
            assert env[contract.ENV_REPORT_CA_FILE] == contract.REPORT_CA_PATH
        else:
            assert contract.ENV_REPORT_CA_FILE not in env
    plain = builders.build_children(_inputs())
    cm = next(c for c in plain if c["kind"] == "ConfigMap")
    assert contract.REPORT_CA_KEY not in cm["data"]
    pod = next(c for c in plain if c["kind"] == "Pod")
    env_names = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    assert contract.ENV_REPORT_CA_FILE not in env_names


def _with_sources(model: str = "builtin://tiny-chain", data: str = "builtin://chain",
                  eval_source: str | None = None, ckpt: str | None = None) -> dict[str, object]:
    spec = _inputs().spec
    upd: dict[str, object] = {
        "model": spec.model.model_copy(update={"source": model}),
        "data": spec.data.model_copy(update={"source": data, "eval_source": eval_source}),
        "checkpoint": spec.checkpoint.model_copy(update={"volume_claim": ckpt}),
    }
    return _pod_specs(_inputs(spec=spec.model_copy(update=upd)))


def _claim_mounts(pod: object) -> dict[str, tuple[str, bool]]:
    """mount path under the claims root -> (claim name, mounted read-only)."""
    vols = {v["name"]: v for v in pod["volumes"]}  # type: ignore[index]
    out = {}
    for m in pod["containers"][0]["volumeMounts"]:  # type: ignore[index]
        if m["mountPath"].startswith(sources.CLAIMS_DIR + "/"):
            claim = vols[m["name"]]["persistentVolumeClaim"]["claimName"]
            out[m["mountPath"]] = (claim, bool(m.get("readOnly")))
    return out


def test_model_and_data_claims_are_mounted_read_only_where_read() -> None:
    pods = _with_sources(model="pvc://models/qwen/v1", data="pvc://datasets/gsm/train.jsonl",
                         eval_source="pvc://held/test.jsonl")
    root = sources.CLAIMS_DIR
    model = {f"{root}/models": ("models", True)}
    # the model's claim where weights or the tokenizer are read; the data's in the driver only
    assert _claim_mounts(pods["learner"]) == model
    assert _claim_mounts(pods["rollout"]) == model
    assert _claim_mounts(pods["driver"]) == {
        **model, f"{root}/datasets": ("datasets", True), f"{root}/held": ("held", True)}
    assert _claim_mounts(pods["head"]) == {}
    # the driver's error reaches the operator as its termination message (DataInvalid)
    main = pods["driver"]["containers"][0]  # type: ignore[index]
    assert main["terminationMessagePolicy"] == "FallbackToLogsOnError"
    for pod in pods.values():
        for v in pod["volumes"]:  # type: ignore[index]
            if v["name"].startswith("source-"):
                assert v["persistentVolumeClaim"]["readOnly"] is True
    # the trainer resolves the same path there
    env = {sources.ENV_CLAIMS_DIR: root}
    assert sources.local_path("pvc://models/qwen/v1", "f", env) == f"{root}/models/qwen/v1"


def test_builtin_sources_mount_no_claim_and_a_shared_claim_is_one_volume() -> None:
    pods = _with_sources()
    for pod in pods.values():
        assert _claim_mounts(pod) == {}
        assert not any(v["name"].startswith("source-") for v in pod["volumes"])  # type: ignore[index]
    # model and data on one claim: one volume, one mount; the checkpoint claim as the
    # model's: the checkpoints volume mounted a second time, read-only, not a second volume
    pods = _with_sources(model="pvc://team/m", data="pvc://team/d.jsonl", ckpt="team")
    driver = pods["driver"]
    assert _claim_mounts(driver) == {f"{sources.CLAIMS_DIR}/team": ("team", True)}
    claims = [v for v in driver["volumes"] if "persistentVolumeClaim" in v]  # type: ignore[index]
    assert [v["name"] for v in claims] == ["checkpoints"]
    rw = [m for m in driver["containers"][0]["volumeMounts"]  # type: ignore[index]
          if m["mountPath"] == contract.CHECKPOINT_DIR]
    assert rw and not rw[0].get("readOnly")
    assert _claim_mounts(pods["rollout"]) == {f"{sources.CLAIMS_DIR}/team": ("team", True)}
    assert [v["name"] for v in pods["rollout"]["volumes"]  # type: ignore[index]
            if "persistentVolumeClaim" in v] == ["source-0"]


@pytest.mark.parametrize("source", ["pvc://Bad_Claim/x", "pvc://claim", "pvc://c/../etc",
                                    "s3://bucket/m", "file://relative/m"])
def test_malformed_model_sources_are_refused_naming_the_field(source: str) -> None:
    spec = _inputs().spec.to_wire()
    spec["model"]["source"] = source
    with pytest.raises(ValueError, match=r"spec\.model\.source"):
        parse_spec(spec)


def test_per_role_resources_env_and_pull_secrets_reach_only_that_roles_pods() -> None:
    spec = _inputs().spec.to_wire()
    spec["rollout"].update(gpusPerReplica=2, resources={
        "requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "40Gi"}},
        env=[{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
        imagePullSecrets=[{"name": "regcred"}])
    spec["trainer"].update(resources={"limits": {"cpu": "8"}})
    spec["driver"] = {"env": [{"name": "TOKENIZERS_PARALLELISM", "value": "true"}],
                      "resources": {"requests": {"cpu": "500m", "memory": "2Gi"}}}
    spec["head"] = {"imagePullSecrets": [{"name": "head-pull"}]}
    pods = _pod_specs(_inputs(spec=parse_spec(spec)))
    main = {role: pod["containers"][0] for role, pod in pods.items()}  # type: ignore[index]
    gpu = contract.GPU_RESOURCE
    assert main["rollout"]["resources"] == {
        "requests": {"cpu": "4", "memory": "32Gi", gpu: "2"},
        "limits": {"memory": "40Gi", gpu: "2"}}
    assert main["learner"]["resources"]["limits"]["cpu"] == "8"
    assert main["driver"]["resources"] == {"requests": {"cpu": "500m", "memory": "2Gi"}}
    assert "resources" not in main["head"]

    def user_env(role: str) -> dict[str, str]:
        return {e["name"]: e["value"] for e in main[role]["env"]
                if e["name"] in ("VLLM_LOGGING_LEVEL", "TOKENIZERS_PARALLELISM")}

    assert user_env("rollout") == {"VLLM_LOGGING_LEVEL": "DEBUG"}
    assert user_env("driver") == {"TOKENIZERS_PARALLELISM": "true"}
    assert user_env("learner") == user_env("head") == {}
    pulls = {role: pod.get("imagePullSecrets") for role, pod in pods.items()}  # type: ignore[union-attr]
    assert pulls == {"rollout": [{"name": "regcred"}], "head": [{"name": "head-pull"}],
                     "learner": None, "driver": None}


@pytest.mark.parametrize(("settings", "match"), [
    ({"resources": {"limits": {"nvidia.com/gpu": "1"}}}, "use the role's gpusPerReplica"),
    ({"resources": {"requests": {"gpu": "1"}}}, "use the role's gpusPerReplica"),
    ({"resources": {"requests": {"widgets": "1"}}}, "cpu, memory, ephemeral-storage"),
    ({"resources": {"requests": {"cpu": "four"}}}, "pattern"),
    ({"env": [{"name": "RLPACER_ROLE", "value": "x"}]}, "set by the operator"),
    ({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, "more than once"),
])
def test_bad_role_settings_are_refused_with_the_fix(settings: dict[str, object],
                                                    match: str) -> None:
    spec = _inputs().spec.to_wire()
    spec["rollout"].update(settings)
    with pytest.raises(ValueError, match=match):
        parse_spec(spec)


NET = builders.JobNetwork(
    report_ports=(8080, 443),
    report_to=({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "sys"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "rlpacer"}}},),
    egress=({"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"port": 443}]},),
)


def _matches(selector: dict[str, object], labels: dict[str, str]) -> bool:
    want = selector.get("matchLabels") or {}
    assert set(selector) <= {"matchLabels"}
    return all(labels.get(k) == v for k, v in want.items())  # type: ignore[union-attr]


def test_no_network_policies_unless_the_operator_is_set_to_give_them() -> None:
    kinds = {o["kind"] for o in builders.build_children(_inputs())}
    assert "NetworkPolicy" not in kinds


def test_a_jobs_network_policies_select_its_pods_and_admit_only_them() -> None:
    inputs = _inputs(network=NET)
    kids = builders.build_children(inputs)
    pols = {o["metadata"]["name"]: o for o in kids if o["kind"] == "NetworkPolicy"}
    assert set(pols) == {"demo-pods", "demo-driver"}
    for pol in pols.values():
        assert pol["metadata"]["ownerReferences"] == [builders.owner_reference(inputs)]
        assert pol["metadata"]["namespace"] == "team"
    pods = pols["demo-pods"]["spec"]
    driver = pols["demo-driver"]["spec"]
    assert pods["policyTypes"] == ["Ingress", "Egress"] and driver["policyTypes"] == ["Egress"]
    # every pod the builders make is selected by the job's policy; the driver by its own too
    workloads = [o for o in kids if o["kind"] in ("StatefulSet", "Pod")]
    assert len(workloads) == 4
    for w in workloads:
        labels = (w["spec"]["template"]["metadata"]["labels"] if w["kind"] == "StatefulSet"
                  else w["metadata"]["labels"])
        assert _matches(pods["podSelector"], labels), labels
        assert _matches(driver["podSelector"], labels) == (w["kind"] == "Pod"), labels
        # and is a peer of the job's own rules (ingress from and egress to the job's pods)
        assert _matches(pods["ingress"][0]["from"][0]["podSelector"], labels)
        assert _matches(pods["egress"][0]["to"][0]["podSelector"], labels)
    # the job's pods: no ports named (Ray's workers and object store use random ports)
    assert "ports" not in pods["ingress"][0] and "ports" not in pods["egress"][0]
    # a pod of another job, or one without the job's labels, matches nothing that admits it
    other = names.labels("other", contract.Role.HEAD)
    assert not _matches(pods["ingress"][0]["from"][0]["podSelector"], other)
    assert not _matches(pods["ingress"][0]["from"][0]["podSelector"], {})
    # no namespaceSelector: the job's own namespace only
    assert set(pods["ingress"][0]["from"][0]) == {"podSelector"}
    # egress: the job, DNS, the extra rule
    assert pods["egress"][1] == builders.DNS_EGRESS
    assert pods["egress"][2] == NET.egress[0]
    assert len(pods["ingress"]) == 1 and len(pods["egress"]) == 3
    # the driver: step reports to the operator's pods on both ports
    assert driver["egress"] == [{"ports": [{"port": 8080, "protocol": "TCP"},
                                           {"port": 443, "protocol": "TCP"}],
                                 "to": list(NET.report_to)}]


def test_network_policies_without_extras_admit_no_scraper_and_report_anywhere() -> None:
    kids = builders.build_children(_inputs(network=builders.JobNetwork(report_ports=(8080,))))
    pols = {o["metadata"]["name"]: o["spec"] for o in kids if o["kind"] == "NetworkPolicy"}
    assert pols["demo-pods"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": names.selector("demo")}}]}]
    assert len(pols["demo-pods"]["egress"]) == 2
    assert pols["demo-driver"]["egress"] == [{"ports": [{"port": 8080, "protocol": "TCP"}]}]


def test_network_policies_stay_while_suspended_or_finished() -> None:
    kids = builders.build_children(_inputs(network=NET, workloads=False))
    assert sorted(o["metadata"]["name"] for o in kids if o["kind"] == "NetworkPolicy") == [
        "demo-driver", "demo-pods"]


def test_every_child_kind_has_its_api_path() -> None:
    """The client applies each child at its kind's path: a kind the builders make and the
    client does not know would fail every pass of the job."""
    from rlpacer.operator.kube import object_path, plural_of

    for workloads in (True, False):
        for obj in builders.build_children(_inputs(network=NET, workloads=workloads)):
            path = object_path(obj["apiVersion"], plural_of(obj["kind"]), "team",
                               obj["metadata"]["name"])
            assert path.endswith(f"/namespaces/team/{plural_of(obj['kind'])}/"
                                 f"{obj['metadata']['name']}"), path
    assert object_path("networking.k8s.io/v1", plural_of("NetworkPolicy"), "team", "x") == (
        "/apis/networking.k8s.io/v1/namespaces/team/networkpolicies/x")


def _wide(tp: int = 4, **kw: object) -> builders.BuildInputs:
    """The example job (rollout 2 replicas x 2 GPUs, long rounds at 4) with wide long-round
    engines of ``tp`` GPUs."""
    base = _inputs(**kw)
    wire = base.spec.to_wire()
    wire["tailBatching"]["longRound"]["tensorParallelSize"] = tp
    return builders.BuildInputs(**{**base.__dict__, "spec": parse_spec(wire)})


@pytest.mark.parametrize("total", [2, 3, 4])
def test_wide_long_round_engines_are_a_statefulset_of_their_own(total: int) -> None:
    """With tailBatching.longRound.tensorParallelSize, the replicas a long round adds are
    pods of a second StatefulSet: as many GPUs as the size, ordinals following the rollout's
    (so replica i is rlpacer.io/rollout-i on either), selected apart from the rollout's; the
    rollout StatefulSet keeps its short-round replicas and its GPUs."""
    children = {c["metadata"]["name"]: c for c in builders.build_children(_wide(
        rollout_replicas=total))}
    rollout, wide = children["demo-rollout"], children["demo-rollout-wide"]
    assert rollout["spec"]["replicas"] == 2 and "ordinals" not in rollout["spec"]
    assert wide["spec"]["replicas"] == total - 2
    assert wide["spec"]["ordinals"] == {"start": 2}
    gpus = {n: c["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        contract.GPU_RESOURCE] for n, c in (("rollout", rollout), ("wide", wide))}
    assert gpus == {"rollout": "2", "wide": "4"}
    tpl = wide["spec"]["template"]["metadata"]["labels"]
    assert tpl[contract.LABEL_ROLE] == "rollout" and tpl[contract.LABEL_POOL] == "wide"
    assert wide["spec"]["selector"]["matchLabels"].items() <= tpl.items()
    # the rollout StatefulSet's selector (immutable, older than the wide pool) matches the
    # wide pods too; its controller adopts no pod another controller owns, and the wide
    # StatefulSet's selector matches none of the rollout's pods
    rollout_tpl = rollout["spec"]["template"]["metadata"]["labels"]
    assert not wide["spec"]["selector"]["matchLabels"].items() <= rollout_tpl.items()
    # the rank the pod's Ray node advertises comes from its ordinal, as on the rollout's pods
    env = {e["name"]: e for e in wide["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[contract.ENV_RANK]["valueFrom"]["fieldRef"]["fieldPath"] == (
        f"metadata.labels['{builders.POD_INDEX_LABEL}']")
    assert ("apps/v1", "statefulsets", "demo-rollout-wide") in builders.workload_names("demo", 2)


def test_without_wide_engines_there_is_one_rollout_statefulset() -> None:
    children = {c["metadata"]["name"]: c for c in builders.build_children(_inputs())}
    assert "demo-rollout-wide" not in children and children["demo-rollout"]["spec"][
        "replicas"] == 3


def test_a_long_rounds_kueue_ask_is_for_the_wide_engines_pods() -> None:
    inputs = _wide(tp=8)
    extra = builders.pod_template_spec(inputs, contract.Role.ROLLOUT, extra=True)
    short = builders.pod_template_spec(inputs, contract.Role.ROLLOUT)
    assert extra["containers"][0]["resources"]["limits"][contract.GPU_RESOURCE] == "8"
    assert short["containers"][0]["resources"]["limits"][contract.GPU_RESOURCE] == "2"
