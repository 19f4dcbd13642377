"""The manual stays true to the repository.

README.md stays a short manual (under 300 lines); every relative link of the README, the
trainer's and the chart's READMEs and ``docs/*.md`` reaches a file, and an ``#anchor`` a heading
of it; every ``rlpacer <sub-command>`` the docs show parses with the CLI's own parser (flags
included), every ``python -m`` module exists, every repository path they name exists, and every
RLTrainingJob or policy manifest they show is valid under the API models. A renamed command,
flag, module, file or heading fails here, naming the page and what broke.

``test_the_checks_catch_drift`` feeds each check a page with one mistake of each kind, so a
check that stopped finding anything would fail too.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from rlpacer.api.job import parse_job
from rlpacer.api.policy import parse_cluster_policy, parse_policy
from rlpacer.cli import build_parser
from rlpacer.operator.settings import OperatorSettings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, ROOT / "trainer_image" / "README.md", ROOT / "charts" / "rlpacer" / "README.md",
         *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 300

FENCE = re.compile(r"^([ \t]*)```(\S*)[^\n]*\n(.*?)^\1```", re.M | re.S)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
# `rlpacer <sub-command> ...` where a shell starts a command: a line's start (after variable
# assignments), after `$(`, a pipe, `;` or `&&`, or at the start of an inline code span.
COMMAND = re.compile(
    r"(?:^|[;&|(]\s*)(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:\.venv/bin/)?rlpacer[ \t]+"
    r"([a-z][\w-]*)([^\n]*)", re.M)
PYTHON_M = re.compile(r"\bpython3?\s+-m\s+([\w.]+)")
# A path inside the repository: one of its top-level folders, then a name.
REPO_PATH = re.compile(
    r"(?<![\w./~-])((?:operator|trainer_image|tests|scripts|hack|examples|charts|images|crds|docs"
    r"|\.ci)/[\w./-]*)")
MANIFEST_PARSERS = {"RLTrainingJob": parse_job, "RLTrainingPolicy": parse_policy,
                    "ClusterRLTrainingPolicy": parse_cluster_policy}


def split_fences(text: str) -> tuple[list[tuple[str, str]], str]:
    """The fenced blocks ((language, body)) and the text outside them."""
    blocks = [(m.group(2), m.group(3)) for m in FENCE.finditer(text)]
    return blocks, FENCE.sub("\n", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    _, prose = split_fences(page.read_text())
    out: set[str] = set()
    for heading in HEADING.findall(prose):
        base = slug(heading)
        name, n = base, 0
        while name in out:  # GitHub numbers repeated headings: x, x-1, x-2
            n += 1
            name = f"{base}-{n}"
        out.add(name)
    return out


def link_problems(page: Path, root: Path = ROOT) -> list[str]:
    _, prose = split_fences(page.read_text())
    prose = INLINE_CODE.sub("", prose)
    out = []
    for target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(root.resolve()) or not dest.exists():
            out.append(f"{page.name}: link {target}: {path} does not exist")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            out.append(f"{page.name}: link {target}: no heading #{anchor} in {dest.name}")
    return out


def code_snippets(page: Path) -> Iterator[tuple[bool, str]]:
    """(in a fenced block, text): every fenced block (shell line continuations joined) and every
    inline code span."""
    blocks, prose = split_fences(page.read_text())
    for _, body in blocks:
        yield True, body.replace("\\\n", " ")
    for span in INLINE_CODE.findall(prose):
        yield False, span


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def command_problems(page: Path, parser: argparse.ArgumentParser) -> tuple[list[str], int]:
    """(problems, commands checked): each `rlpacer X ...` names a sub-command, and in a fenced
    block its arguments parse; with placeholders (`$V`, `<job>`), and in prose (`rlpacer run`
    names the command), only its flags are checked."""
    subs = subparsers(parser)
    out, checked = [], 0
    for block, snippet in code_snippets(page):
        for m in COMMAND.finditer(snippet):
            name, rest = m.group(1), m.group(2)
            checked += 1
            if name not in subs:
                out.append(f"{page.name}: `rlpacer {name}`: no such sub-command ({sorted(subs)})")
                continue
            args = shlex.split(re.split(r"[#);&|\"`]", rest, maxsplit=1)[0])
            if (not block or any(c in a for a in args for c in "$<{*")
                    or {"-h", "--help"} & set(args)):
                known = subs[name]._option_string_actions
                out += [f"{page.name}: `rlpacer {name}`: unknown flag {a}"
                        for a in args if a.startswith("-") and a.split("=")[0] not in known]
                continue
            with contextlib.redirect_stderr(io.StringIO()) as err:
                try:
                    ns = parser.parse_args([name, *args])
                    if name == "operator":  # its flags are settings, checked together at start
                        OperatorSettings.load(env={}, overrides={
                            f: getattr(ns, f) for f in OperatorSettings.model_fields
                            if hasattr(ns, f)})
                except SystemExit as e:
                    last = [str(e.code)] if isinstance(e.code, str) else (
                        err.getvalue().strip().splitlines()[-1:])
                    out.append(f"{page.name}: `rlpacer {name} {' '.join(args)}`: {last}")
    return out, checked


def module_problems(page: Path) -> list[str]:
    out = []
    for _, snippet in code_snippets(page):
        for module in PYTHON_M.findall(snippet):
            try:
                found = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                out.append(f"{page.name}: `python -m {module}`: no such module")
    return out


def path_problems(page: Path, root: Path = ROOT) -> list[str]:
    out = []
    for _, snippet in code_snippets(page):
        for path in REPO_PATH.findall(snippet):
            if not (root / path.rstrip(".")).exists():
                out.append(f"{page.name}: {path} does not exist")
    return out


def manifest_problems(page: Path) -> list[str]:
    out = []
    blocks, _ = split_fences(page.read_text())
    for lang, body in blocks:
        if lang not in ("yaml", "yml"):
            continue
        for obj in yaml.safe_load_all(body):  # a block may hold several documents
            parse = MANIFEST_PARSERS.get(obj.get("kind", "")) if isinstance(obj, dict) else None
            if parse is None:
                continue
            try:
                parse(obj)
            except Exception as e:  # the parsers raise their own error types, the field named
                out.append(f"{page.name}: {obj['kind']} {obj['metadata']['name']}: {e}")
    return out


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def test_readme_is_a_short_manual() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) < MAX_README_LINES, (
        f"README.md has {len(lines)} lines: move detail to docs/ and link it")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_heading(page: Path) -> None:
    assert link_problems(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_rlpacer_command_shown_parses(page: Path, parser: argparse.ArgumentParser) -> None:
    problems, _ = command_problems(page, parser)
    assert problems == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_and_repository_path_shown_exists(page: Path) -> None:
    assert module_problems(page) + path_problems(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_manifest_shown_is_valid(page: Path) -> None:
    assert manifest_problems(page) == []


def test_the_readme_shows_the_commands_a_user_runs(parser: argparse.ArgumentParser) -> None:
    """The checks above run on real material: the README's blocks name the two scripts, the
    examples and the user-facing sub-commands."""
    _, checked = command_problems(README, parser)
    assert checked >= 10
    blocks = "\n".join(body for _, body in split_fences(README.read_text())[0])
    for needed in ("scripts/run.sh", "scripts/test.sh", "examples/tiny-local.yaml",
                   "examples/tiny-cluster.yaml", "rlpacer run", "rlpacer dev-cluster up"):
        assert needed in blocks
    assert len(LINK.findall(README.read_text())) >= 10


def test_the_checks_catch_drift(tmp_path: Path, parser: argparse.ArgumentParser) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](other.md#a-section) [gone](missing.md) [bad anchor](other.md#no-such-section)\n"
        "[self](#page) [not self](#nowhere) [web](https://example.com/x)\n\n"
        "```sh\n"
        ".venv/bin/rlpacer run examples/tiny-local.yaml --steps 5\n"
        ".venv/bin/rlpacer trian examples/tiny-local.yaml\n"
        "rlpacer run examples/tiny-local.yaml --no-such-flag\n"
        "eval \"$(.venv/bin/rlpacer dev-cluster upp)\"\n"
        "rlpacer bench-operator --jobs $N --no-such-flag\n"
        ".venv/bin/rlpacer operator --report-port 8080 --report-url http://127.0.0.1:8080\n"
        "python -m rlpacer_trainer.no_such_module\n"
        "kubectl apply -f examples/no-such-job.yaml && bash scripts/no-such.sh\n"
        "```\n\n"
        "```yaml\napiVersion: rlpacer.io/v1alpha1\nkind: RLTrainingJob\n"
        "metadata: {name: x}\nspec: {model: {source: builtin://tiny-chain},\n"
        "  data: {source: builtin://chain}, steps: 1, promptsPerStep: 1, groupSizee: 3}\n```\n")
    links = link_problems(page, root=tmp_path)
    assert len(links) == 3 and all(
        any(s in p for p in links) for s in ("missing.md", "#no-such-section", "#nowhere"))
    commands, checked = command_problems(page, parser)
    assert checked == 6
    assert [p.split(": ", 1)[1].split("`")[1] for p in commands] == [
        "rlpacer trian", "rlpacer run examples/tiny-local.yaml --no-such-flag",
        "rlpacer dev-cluster upp", "rlpacer bench-operator",
        "rlpacer operator --report-port 8080 --report-url http://127.0.0.1:8080"]
    assert "must start with https://" in commands[-1]  # the operator's settings, checked
    assert "no_such_module" in " ".join(module_problems(page))
    paths = path_problems(page)
    assert len(paths) == 2 and "examples/no-such-job.yaml" in paths[0]
    assert "scripts/no-such.sh" in paths[1]
    assert "groupSizee" in " ".join(manifest_problems(page))
    # and the anchors follow GitHub's rules
    assert slug("Step-report protocol: versions") == "step-report-protocol-versions"
    assert slug("A job's Secrets") == "a-jobs-secrets"
    assert slug("`rlpacer bench`: scheduling, simulated") == "rlpacer-bench-scheduling-simulated"
