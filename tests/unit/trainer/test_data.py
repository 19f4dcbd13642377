"""Prompt data from JSON Lines files: fields from the spec (nested keys), held-out splits, the
project's word-problem generator, and bad data refused at start naming the file, the line and
the field (the pod exits with contract.EXIT_DATA_INVALID)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from rlpacer.api import contract
from rlpacer_trainer import data, hfrecipe, pod, wordproblems
from rlpacer_trainer.config import DataInvalid, RunConfig

pytestmark = pytest.mark.unit
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-local.yaml"


@pytest.fixture(scope="module")
def user_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hfrecipe.make(tmp_path_factory.mktemp("hf") / "user-model")


@pytest.fixture(scope="module")
def problems(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wordproblems.write(tmp_path_factory.mktemp("data") / "wp.jsonl", 300, seed=3)


def _manifest(tmp_path: Path, model: Path | str, **data_spec: object) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"]["source"] = str(model)
    doc["spec"]["data"] = {"promptField": "question", "answerField": "answer", **data_spec}
    doc["spec"]["rollout"]["maxResponseTokens"] = 64
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def _lines(tmp_path: Path, *lines: str, name: str = "bad.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(ln + "\n" for ln in lines))
    return p


def test_word_problems_are_seeded_and_boxed(problems: Path) -> None:
    recs = [json.loads(ln) for ln in problems.read_text().splitlines()]
    assert len(recs) == 300 and recs == wordproblems.make(300, seed=3)
    assert recs != wordproblems.make(300, seed=4)
    for r in recs:
        assert r["solution"].endswith(f"\\boxed{{{r['answer']}}}") and int(r["answer"]) >= 0
        last = re.findall(r"= (-?\d+)", r["solution"])[-1]  # the worked arithmetic holds
        assert last == r["answer"]
    assert {r["meta"]["kind"] for r in recs} == {"give", "buy", "share", "boxes", "two-step"}


def test_a_run_reads_a_file_with_the_spec_fields_and_system_prompt(
        user_model: Path, problems: Path, tmp_path: Path) -> None:
    cfg = RunConfig.load(_manifest(tmp_path, user_model, source=f"file://{problems}",
                                   systemPrompt="Answer with \\boxed{}."))
    train = cfg.problems()
    first = json.loads(problems.read_text().splitlines()[0])
    assert len(train) == 300 == cfg.num_prompts and cfg.eval_problems() == []
    assert (train[0].prompt, train[0].reference) == (first["question"], first["answer"])
    assert train[0].where == f"{problems}:1"
    text = cfg.tokenizer().tok.decode(cfg.tokenizer().prompt_ids(train[0].prompt))  # type: ignore[attr-defined]
    assert text.startswith("<|im_start|>system\nAnswer with \\boxed{}.<|im_end|>")
    assert cfg.max_prompt_tokens == max(len(cfg.tokenizer().prompt_ids(p.prompt)) for p in train)


def test_nested_fields(tmp_path: Path) -> None:
    p = _lines(tmp_path, json.dumps({"meta": {"q": "1+1?"}, "sol": {"ans": 2}}),
               "", json.dumps({"meta": {"q": "2+2?"}, "sol": {"ans": "4"}}), name="n.jsonl")
    got = data.read_jsonl(p, "meta.q", "sol.ans", spec_field="spec.data.source")
    assert [(e.pid, e.prompt, e.answer, e.where) for e in got] == [
        (0, "1+1?", "2", f"{p}:1"), (1, "2+2?", "4", f"{p}:3")]


def test_held_out_split_by_fraction_and_by_file(user_model: Path, problems: Path,
                                                tmp_path: Path) -> None:
    split = RunConfig.load(_manifest(tmp_path, user_model, source=str(problems),
                                     evalFraction="0.2", seed=5))
    train, held = split.problems(), split.eval_problems()
    assert (len(train), len(held)) == (240, 60) and split.num_prompts == 240
    assert not {e.where for e in train} & {e.where for e in held}
    assert [e.pid for e in train] == list(range(240))  # the driver indexes by pid
    again = RunConfig.load(_manifest(tmp_path, user_model, source=str(problems),
                                     evalFraction="0.2", seed=5))
    other = RunConfig.load(_manifest(tmp_path, user_model, source=str(problems),
                                     evalFraction="0.2", seed=6))
    assert again.eval_problems() == held and other.eval_problems() != held
    held_file = wordproblems.write(tmp_path / "held.jsonl", 20, seed=99)
    by_file = RunConfig.load(_manifest(tmp_path, user_model, source=str(problems),
                                       evalSource=f"file://{held_file}"))
    assert len(by_file.problems()) == 300 and len(by_file.eval_problems()) == 20
    assert by_file.eval_problems()[0].where == f"{held_file}:1"
    with pytest.raises(ValueError, match="evalFraction or evalSource, not both"):
        RunConfig.load(_manifest(tmp_path, user_model, source=str(problems),
                                 evalSource=str(held_file), evalFraction="0.1"))
    with pytest.raises(ValueError, match=r"spec.data.evalFraction: evalFraction must be <= 0.5"):
        RunConfig.load(_manifest(tmp_path, user_model, source=str(problems), evalFraction="0.9"))


GOOD = json.dumps({"question": "Mia has 2 apples.", "answer": "2"})


def _parquet(path: Path, rows: list[dict[str, object]], row_group_size: int = 64) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def test_a_parquet_source_reads_like_its_json_lines(user_model: Path, problems: Path,
                                                    tmp_path: Path) -> None:
    """The same records as Parquet (several row groups, the nested ``meta`` as a struct
    column): the same examples, each named by its row; a held-out split by fraction is the
    same; a Parquet held-out file works beside a JSON Lines source."""
    recs = [json.loads(ln) for ln in problems.read_text().splitlines()]
    pq_file = _parquet(tmp_path / "wp.parquet", recs)
    as_jsonl = RunConfig.load(_manifest(tmp_path, user_model, source=str(problems),
                                        evalFraction="0.2", seed=5))
    as_pq = RunConfig.load(_manifest(tmp_path, user_model, source=f"file://{pq_file}",
                                     evalFraction="0.2", seed=5))
    for a, b in ((as_jsonl.problems(), as_pq.problems()),
                 (as_jsonl.eval_problems(), as_pq.eval_problems())):
        assert [(e.pid, e.prompt, e.answer) for e in a] == [(e.pid, e.prompt, e.answer) for e in b]
        assert [e.where.replace(str(problems), str(pq_file)) for e in a] == [e.where for e in b]
    nested = data.read_jsonl(pq_file, "meta.kind", "answer", spec_field="spec.data.source")
    assert [e.prompt for e in nested] == [r["meta"]["kind"] for r in recs]
    held = _parquet(tmp_path / "held.parquet", wordproblems.make(20, seed=99))
    mixed = RunConfig.load(_manifest(tmp_path, user_model, source=str(problems),
                                     evalSource=str(held)))
    assert len(mixed.eval_problems()) == 20 and mixed.eval_problems()[0].where == f"{held}:1"


@pytest.mark.parametrize(("rows", "row", "why"), [
    ([{"question": "a", "answer": "1"}] * 70 + [{"question": None, "answer": "1"}], 71,
     r"field 'question' \(spec.data.promptField\) is a null"),
    ([{"question": "a", "answer": "1"}, {"question": "", "answer": "1"}], 2, "is empty"),
])
def test_bad_parquet_rows_name_the_file_row_and_field(
        user_model: Path, tmp_path: Path, rows: list[dict[str, object]], row: int,
        why: str) -> None:
    bad = _parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataInvalid, match=rf"spec\.data\.source: {bad} row {row}: .*{why}"):
        RunConfig.load(_manifest(tmp_path, user_model, source=str(bad)))
    # a column the spec names that the file lacks
    other = _parquet(tmp_path / "other.parquet", [{"q": "a", "answer": "1"}])
    with pytest.raises(DataInvalid,
                       match=r"row 1: field 'question' .*missing.*found: \['answer', 'q'\]"):
        RunConfig.load(_manifest(tmp_path, user_model, source=str(other)))


@pytest.mark.parametrize(("lines", "line", "why"), [
    ([GOOD, "{not json"], 2, "not valid JSON"),
    ([GOOD, GOOD, json.dumps([1, 2])], 3, "a JSON list, expected an object"),
    ([json.dumps({"q": "x", "answer": "1"})], 1,
     r"field 'question' \(spec.data.promptField\) missing: no question"
     r" \(found: \['answer', 'q'\]\)"),
    ([GOOD, json.dumps({"question": "x"})], 2, r"field 'answer' \(spec.data.answerField\) missing"),
    ([json.dumps({"question": "x", "answer": None})], 1, "is a null"),
    ([json.dumps({"question": 7, "answer": "1"})], 1, "the prompt must be text"),
    ([json.dumps({"question": "  ", "answer": "1"})], 1, "is empty"),
])
def test_bad_records_name_the_file_line_and_field(user_model: Path, tmp_path: Path,
                                                  lines: list[str], line: int, why: str) -> None:
    bad = _lines(tmp_path, *lines)
    with pytest.raises(DataInvalid, match=rf"spec\.data\.source: {bad} line {line}: .*{why}"):
        RunConfig.load(_manifest(tmp_path, user_model, source=str(bad)))


def test_bad_files_and_long_prompts_are_data_errors(user_model: Path, problems: Path,
                                                    tmp_path: Path) -> None:
    cases = {
        str(tmp_path / "nope.jsonl"): "no such file",
        str(_lines(tmp_path, name="empty.jsonl")): "no records",
        str(_lines(tmp_path, GOOD, name="x.parquet")): "not a readable Parquet file",
    }
    (tmp_path / "latin1.jsonl").write_bytes(b'{"question": "caf\xe9", "answer": "1"}\n')
    cases[str(tmp_path / "latin1.jsonl")] = "not UTF-8"
    for source, why in cases.items():
        with pytest.raises(DataInvalid, match=rf"spec\.data\.source: .*{why}"):
            RunConfig.load(_manifest(tmp_path, user_model, source=source))
    held = tmp_path / "held-missing.jsonl"
    with pytest.raises(DataInvalid, match=r"spec\.data\.evalSource: .*no such file"):
        RunConfig.load(_manifest(tmp_path, user_model, source=str(problems), evalSource=str(held)))
    # a prompt over rollout.maxPromptTokens: the file and line are named
    doc = yaml.safe_load(_manifest(tmp_path, user_model, source=str(problems)).read_text())
    doc["spec"]["rollout"]["maxPromptTokens"] = 30
    (tmp_path / "capped.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(DataInvalid, match=rf"maxPromptTokens: 30, .*\({problems}:\d+: "):
        RunConfig.load(tmp_path / "capped.yaml")
    # text prompts with the builtin tiny model: the character vocabulary is named
    with pytest.raises(DataInvalid, match=rf"{problems}:1: .*not in the builtin model's vocab"):
        RunConfig.load(_manifest(tmp_path, "builtin://tiny-chain", source=str(problems)))


def test_the_pod_exits_with_the_data_invalid_code(user_model: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    bad = _lines(tmp_path, GOOD, "{oops")
    env = {contract.ENV_ROLE: "driver",
           contract.ENV_CONFIG: str(_manifest(tmp_path, user_model, source=str(bad))),
           contract.ENV_CHECKPOINT_DIR: str(tmp_path / "ckpt")}
    assert pod.main(env) == contract.EXIT_DATA_INVALID == 4
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: data invalid: spec.data.source: {bad} line 2: not valid JSON")
    # a config error (good data, a missing model) stays 2: not DataInvalid
    doc = yaml.safe_load(Path(env[contract.ENV_CONFIG]).read_text())
    doc["spec"]["data"]["source"] = str(_lines(tmp_path, GOOD, name="good.jsonl"))
    doc["spec"]["model"]["source"] = str(tmp_path / "no-model")
    Path(env[contract.ENV_CONFIG]).write_text(yaml.safe_dump(doc))
    assert pod.main(env) == 2
