"""The checked-in key vectors match the Python reference of the documented scheme."""

import json

import keyref


def test_vectors_match_reference():
    assert json.loads(keyref.VECTORS.read_text()) == json.loads(json.dumps(keyref.vectors()))


def test_namespace_changes_every_key():
    a = dict(keyref.CASES[0]["ns"])
    b = dict(a, tp=(2, 0))
    toks = list(range(32))
    ka, kb = keyref.token_keys(a, toks), keyref.token_keys(b, toks)
    assert len(ka) == 2 and all(x != y for x, y in zip(ka, kb))
