"""Apply patches are YAML: the operator's JSON must read back exactly through a YAML decoder,
whatever characters a job's spec carries into its children."""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from rlpacer.operator.kube import yaml_json

pytestmark = pytest.mark.unit

# what the API server can hand back in a string: any Unicode scalar value
text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
body = st.recursive(st.none() | st.booleans() | st.integers() | text,
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(text, inner, max_size=3), max_leaves=12)


def test_characters_past_the_bmp_and_unprintable_ones_survive_yaml() -> None:
    obj = {"data": {"model": "pvc://c/\U0001f600-\x88-\x7f-\x0f-\ufffe-\u00e9",
                    "k\u2028": "\x85\ufeff"}}
    # json.dumps alone: a surrogate-pair escape, which YAML decoders refuse or misread
    assert yaml.safe_load(json.dumps(obj)) != obj
    out = yaml_json(obj)
    assert yaml.safe_load(out) == obj == json.loads(out)
    assert "\U0001f600" in out and "\\ud83d" not in out


@settings(max_examples=300, deadline=None)
@given(body)
def test_any_body_reads_back_through_yaml_and_json(obj: object) -> None:
    out = yaml_json(obj)
    assert json.loads(out) == obj
    assert yaml.safe_load(out) == obj
