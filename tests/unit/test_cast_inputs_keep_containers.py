"""cast_inputs_keep_containers in one process: what the unit gets for torch's cast walk
(``_apply_to_tensors``), and what a unit's change hands back to the caller (replaced and removed
keys, list edits other than appends, dataclass fields, tuples), beside the 2-rank runs."""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.distributed.utils import _apply_to_tensors

from fsdp_autopatch.patches import cast_inputs_keep_containers as patch


@dataclasses.dataclass
class Holder:
    value: torch.Tensor
    extra: list


def _unit_gets(caller):
    cast = functools.partial(lambda dtype, t: t.to(dtype) if t.is_floating_point() else t, torch.bfloat16)
    pairing = patch._Pairing()
    return pairing.unit_gets(caller, _apply_to_tensors(cast, caller)), pairing


def _hand_back(pairing):
    return [patch._hand_back(given, pairing.originals) for given in pairing.given]


def test_a_container_with_nothing_cast_is_the_callers_own():
    caller = {"ints": [1, 2], "nested": ({"k": "v"},), "empty": []}
    unit, pairing = _unit_gets(caller)
    assert unit is caller and unit["empty"] is caller["empty"]
    unit["empty"].append(1)
    assert _hand_back(pairing).count(True) == 1  # the list changed (counted), nothing to hand back


def test_a_copy_keeps_the_casts_and_the_callers_inner_containers():
    fp32 = torch.ones(2)
    caller = {"t": fp32, "kept": [], "pair": (fp32, "x")}
    unit, _ = _unit_gets(caller)
    assert unit is not caller and unit["t"].dtype == torch.bfloat16
    assert unit["kept"] is caller["kept"] and unit["pair"][1] == "x" and unit["pair"][0].dtype == torch.bfloat16


def test_dict_keys_new_replaced_removed_reach_the_caller():
    caller = {"a": torch.ones(1), "b": torch.zeros(1), "c": 3}
    unit, pairing = _unit_gets(caller)
    unit["new"] = "n"
    unit["c"] = 4
    del unit["b"]
    unit["moved"] = unit["a"]  # torch's cast of the caller's tensor goes back as the caller's own
    _hand_back(pairing)
    assert set(caller) == {"a", "c", "new", "moved"} and caller["c"] == 4 and caller["moved"] is caller["a"]
    assert caller["a"].dtype == torch.float32


def test_list_appends_keep_the_callers_items_other_edits_replace_them():
    first = torch.ones(1)
    caller = [first]
    unit, pairing = _unit_gets(caller)
    unit.append("x")
    _hand_back(pairing)
    assert caller == [first, "x"] and caller[0] is first
    caller = [first, torch.zeros(1)]
    unit, pairing = _unit_gets(caller)
    unit.reverse()
    _hand_back(pairing)
    assert caller[1] is first and caller[0].dtype == torch.float32


def test_dataclass_fields_and_nested_lists():
    caller = Holder(torch.ones(1), [torch.zeros(1)])
    unit, pairing = _unit_gets(caller)
    assert unit is not caller and unit.extra is not caller.extra  # the list holds a cast tensor: copied
    unit.extra.append("aux")
    unit.value = "replaced"
    _hand_back(pairing)
    assert caller.value == "replaced" and len(caller.extra) == 2 and caller.extra[0].dtype == torch.float32


def test_unchanged_containers_hand_back_nothing():
    caller = ([torch.ones(1)], {"k": torch.ones(1)}, Holder(torch.ones(1), []))
    unit, pairing = _unit_gets(caller)
    before = [list(caller[0]), dict(caller[1])]
    assert _hand_back(pairing) == [False] * len(pairing.given)
    assert [list(caller[0]), dict(caller[1])] == before
