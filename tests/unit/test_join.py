"""ballast.model.protocol.Join: the one row type every engine's batch takes, checked where built."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from ballast.model.batching import check_joins, refuse_adapter
from ballast.model.protocol import GREEDY, Join, RowSampling


def test_a_join_names_its_fields_and_keeps_its_ids_as_a_tuple():
    ids = [72, 105]
    join = Join("k", ids, 4)
    assert (join.key, join.ids, join.max_new_tokens) == ("k", (72, 105), 4)
    assert (join.sampling, join.adapter, join.cache_salt) == (None, None, None)
    ids.append(33)  # the caller's list is not the join's
    assert join.ids == (72, 105) and join == Join("k", (72, 105), 4)
    full = Join(("s", 1), [1], 0, GREEDY, adapter="sql", cache_salt="group-a")
    assert (full.sampling, full.adapter, full.cache_salt) == (GREEDY, "sql", "group-a")
    assert pickle.loads(pickle.dumps(full)) == full and hash(full) == hash(pickle.loads(pickle.dumps(full)))


def test_a_join_is_frozen_and_has_no_room_for_other_fields():
    join = Join(1, [1], 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        join.max_new_tokens = 2  # type: ignore[misc]
    assert not hasattr(join, "__dict__")  # slots: a misspelt field is no new attribute


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"key": [1]}, "key"),  # unhashable: no batch could find the row
        ({"ids": "Hi"}, "ids"),  # text, not token ids
        ({"ids": None}, "ids"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"max_new_tokens": 2.0}, "max_new_tokens"),
        ({"sampling": {"temperature": 1.0}}, "sampling"),
        ({"adapter": ""}, "adapter"),
        ({"adapter": 3}, "adapter"),
        ({"cache_salt": ""}, "cache_salt"),
    ],
)
def test_a_field_of_the_wrong_kind_is_refused_where_the_join_is_built(kwargs, field):
    args = {"key": "k", "ids": [1, 2], "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=f"^Join.{field} "):
        Join(**args)


def test_ids_outside_a_vocabulary_are_the_engines_to_refuse_not_the_joins():
    # A resumed stream's ids come from the client's side: the batch refuses that row alone
    # (``refuse_bad_ids``), so building its join must not fail the chunk.
    assert Join("k", [-1, 10**9], 4).ids == (-1, 10**9)


def test_a_chunk_takes_joins_only_each_key_once():
    check_joins([Join("a", [1], 1), Join("b", [1], 1)], ["c"])
    with pytest.raises(TypeError, match="a batch takes Join rows, got tuple"):
        check_joins([Join("a", [1], 1), ("b", [1], 1)], [])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="key 'c' is already in the batch"):
        check_joins([Join("c", [1], 1)], ["c"])
    with pytest.raises(ValueError, match="key 'a' is already in the batch"):
        check_joins([Join("a", [1], 1), Join("a", [2], 1)], [])


def test_an_engine_without_adapters_refuses_a_row_that_names_one():
    assert refuse_adapter(Join("k", [1], 1, RowSampling(temperature=0.5))) is None
    refused = refuse_adapter(Join("k", [1], 1, adapter="sql"))
    assert refused is not None and refused.field == "model" and "adapter 'sql' of row 'k'" in str(refused)
