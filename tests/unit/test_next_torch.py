"""The plugin's verdicts on a simulated next torch, in this process (no process group).

Each change of ``_next_torch_changes.CHANGES`` is simulated on the installed torch (``_next_torch``:
torch's functions re-executed from their edited source), the plugin activated on it with
``torch.__version__`` reading as installed and as 2.16.0 (outside the measured releases: the
structural checks decide alone), and its registry compared with ``_next_torch_expected.EXPECTED``
(keyed on the shape of the code each change edits, never on the release: the suite runs on every
torch; a change whose code this torch lacks skips).
Then what needs no process group: a wrapper called with the new keyword argument, gradient
clipping of plain tensors with and without the plugin, and the simulation itself (faithful
bytecode, exact undo). The values on gloo ranks: ``tests/distributed/test_dist_next_torch.py``.
"""

from __future__ import annotations

import importlib
import inspect
import linecache
import warnings

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
import torch.distributed.checkpoint.state_dict  # noqa: E402, F401  (and the hook of the entries that wait for it)
import torch.distributed.fsdp  # noqa: E402, F401  (fires the post-import hook if the .pth is active)

import _next_torch as nt  # noqa: E402
import _next_torch_changes as ch  # noqa: E402
import _next_torch_edits as ed  # noqa: E402
import _next_torch_expected as nx  # noqa: E402
import fsdp_autopatch  # noqa: E402
from fsdp_autopatch import _activate  # noqa: E402

VERSIONS = {"installed": None, "next": nt.NEXT_VERSION}


@pytest.fixture(autouse=True)
def plugin_active():
    fsdp_autopatch.install()
    yield
    _activate.activate()  # whatever a test did, the process is left patched as it found it


def _outcome(case: str, scenario=None, version: str | None = nt.NEXT_VERSION) -> dict:
    result = nt.on_simulated_torch(ch.CHANGES[case], scenario, version=version, label=case)
    if "skipped" in result:
        pytest.skip(result["skipped"])
    return result


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", ch.CHANGES)
def test_verdict(case: str, version: str) -> None:
    result = _outcome(case, version=VERSIONS[version])
    patch = nx.patch_of(case)
    problem = nx.status_problem(case, result["status"][patch])
    assert problem is None, f"{patch}: {problem}"
    for other in nx.ALSO.get(case, {}):
        problem = nx.status_problem(case, result["status"][other], other)
        assert problem is None, f"{other}: {problem}"
    broken = {n: s["status"] for n, s in result["status"].items() if s["status"] in ("failed", "pending")}
    assert not broken, broken
    assert all(s["reason"] for s in result["status"].values())


def _never_unsharded_param():
    fsdp_param = object.__new__(nt.fsdp("_fsdp_param").FSDPParam)  # its unit never ran forward
    fsdp_param.reduce_dtype = torch.float32
    return fsdp_param


def test_guard_takes_the_new_keyword() -> None:
    """The guard's wrapper, called as the simulated post_backward calls it, returns early; torch's
    method alone raises the bug's AttributeError."""

    def call() -> dict:
        method = nt.fsdp("_fsdp_param").FSDPParam.to_accumulated_grad_if_needed
        return {"result": method(_never_unsharded_param(), **{nt.NEW: True})}

    result = _outcome("accumulated_grad_guard/new_keyword", call)
    assert result["on"] == {"error": None, "result": None}
    assert result["off"]["error"]["type"] == "AttributeError", result["off"]
    assert "_unsharded_param" in result["off"]["error"]["message"]


def test_applied_means_the_reference_under_another_name_is_wrapped() -> None:
    """``from ._fsdp_collectives import foreach_reduce as _reduce_scatter_grads``: applied only if the
    binding post_backward calls is replaced too (found by the object, not by its name)."""
    collectives, group = nt.fsdp("_fsdp_collectives"), nt.fsdp("_fsdp_param_group")
    _activate.revert_all()
    original = collectives.foreach_reduce  # torch's, which the simulated release binds under another name
    def replaced() -> dict:
        return {"replaced": group._reduce_scatter_grads is not original}

    result = _outcome("uniform_reduce_dtype/imported_as", replaced)
    assert result["off"] == {"error": None, "replaced": False}
    if result["status"]["uniform_reduce_dtype"]["status"] == "applied":
        assert result["on"] == {"error": None, "replaced": True}
    else:
        assert result["on"] == result["off"]


def _plain_clipping(dtype: torch.dtype | None) -> dict:
    """clip_grad_norm_ and get_total_norm over plain tensors: what torch gives, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=generator)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * 3
    extra = {} if dtype is None else {"dtype": dtype}
    total = torch.nn.utils.clip_grad_norm_(params, 0.5, 2.0, **extra)
    again = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, False, None, **extra)
    return {"total": total, "again": again, "grads": [p.grad for p in params]}


@pytest.mark.parametrize("dtype", [None, torch.float64])
@pytest.mark.parametrize("case", [c for c in ch.CHANGES if c.startswith("clip_grad_norm_multi_mesh/")])
def test_clipping_plain_tensors_is_torchs(case: str, dtype: torch.dtype | None) -> None:
    if dtype is not None and not case.endswith("/dtype"):
        pytest.skip("only PyTorch PR 194033's torch has a dtype parameter")
    result = _outcome(case, lambda: _plain_clipping(dtype))
    on, off = result["on"], result["off"]
    assert on["error"] is None, on["error"]["traceback"]
    assert off["error"] is None, off["error"]["traceback"]
    assert on["total"].dtype == (dtype or torch.float32)
    for key in ("total", "again"):
        assert torch.equal(on[key], off[key]) and on[key].dtype == off[key].dtype, key
    assert all(torch.equal(a, b) for a, b in zip(on["grads"], off["grads"]))


# --- the simulation itself ----------------------------------------------------------------------


def _torch_objects() -> dict:
    """Every attribute of the loaded torch modules and of their classes, by identity."""
    found = {}
    with warnings.catch_warnings():  # isinstance() of torch.distributed.reduce_op warns
        warnings.simplefilter("ignore")
        _collect(found)
    return found


def _collect(found: dict) -> None:
    for module in nt.torch_modules():
        for name, value in list(vars(module).items()):
            found[(module.__name__, name)] = value
            if isinstance(value, type) and str(vars(value).get("__module__", "")).startswith("torch"):
                for member, item in list(vars(value).items()):
                    found[(module.__name__, name, member)] = item


def test_every_change_is_undone_exactly() -> None:
    _activate.revert_all()
    before, files = _torch_objects(), set(linecache.cache)
    for case, change in ch.CHANGES.items():
        nt.on_simulated_torch(change, label=case)
        _activate.revert_all()
    after = _torch_objects()
    modules = {key[0] for key in before}  # modules torch imported meanwhile are not ours to judge
    changed = [key for key in set(before) | {k for k in after if k[0] in modules}
               if before.get(key, before) is not after.get(key, before)]
    assert not changed, changed
    assert not {name for name in linecache.cache if str(name).startswith("<next torch")} - files


def test_a_new_keyword_is_in_torchs_bytecode() -> None:
    fsdp_param = nt.fsdp("_fsdp_param").FSDPParam
    _activate.revert_all()
    original = vars(fsdp_param)["_setattr_on_modules"]
    sim = nt.Simulation("test")
    ch.CHANGES["keep_param_attributes/new_keyword"](sim)
    with sim:
        setter = vars(fsdp_param)["_setattr_on_modules"]
        parameter = inspect.signature(setter).parameters[nt.NEW]
        assert parameter.kind is parameter.KEYWORD_ONLY and parameter.default is None
        assert setter.__qualname__ == "FSDPParam._setattr_on_modules" and setter.__module__ == original.__module__
        assert setter.__globals__ is original.__globals__  # torch's live namespace, not a copy
        for name in ("_init_sharded_param", "to_sharded", "to_unsharded"):
            caller = nt.innermost(vars(fsdp_param)[name])
            assert (nt.NEW,) in caller.__code__.co_consts, name  # the call passes it by keyword
    assert vars(fsdp_param)["_setattr_on_modules"] is original


def test_a_rename_leaves_no_reference_and_rebinds_every_import_site() -> None:
    collectives, group = nt.fsdp("_fsdp_collectives"), nt.fsdp("_fsdp_param_group")
    clip = importlib.import_module("torch.nn.utils.clip_grad")
    _activate.revert_all()
    original = collectives.foreach_reduce
    sim = nt.Simulation("test")
    ch.CHANGES["uniform_reduce_dtype/renamed"](sim)
    ch.CHANGES["clip_grad_norm_multi_mesh/renamed"](sim)
    with sim:
        assert not hasattr(collectives, "foreach_reduce") and not hasattr(group, "foreach_reduce")
        assert group.foreach_reduce_grads is collectives.foreach_reduce_grads
        assert nt.callers("foreach_reduce") == [] and nt.callers("_get_total_norm") == []
        assert torch.nn.utils.get_total_norm is clip._compute_total_norm  # imported under another name
    assert group.foreach_reduce is collectives.foreach_reduce is original


def test_zero_argument_super_gets_its_class_cell() -> None:
    fsdp_module = nt.fsdp("_fully_shard").FSDPModule
    _activate.revert_all()
    original = vars(fsdp_module)["_apply"]
    if "__class__" not in nt.innermost(original).__code__.co_freevars:
        pytest.skip("FSDPModule._apply does not use super() in this torch")
    sim = nt.Simulation("test")
    sim.edit(fsdp_module, "_apply", ed.insert_first("pass"))
    with sim:
        rebuilt = nt.innermost(vars(fsdp_module)["_apply"])
        assert rebuilt is not nt.innermost(original)
        cell = rebuilt.__closure__[rebuilt.__code__.co_freevars.index("__class__")]
        assert cell.cell_contents is fsdp_module
    assert vars(fsdp_module)["_apply"] is original


def test_edits_keep_torchs_text() -> None:
    source = "@decorator\ndef f(a, b=1):  # é\n    '''doc'''\n    return g(a, b) + h.g()\n"
    text = ed.add_parameter("x")(source)
    text = ed.pass_argument("g", "x", "True")(text)
    text = ed.insert_first("record(x)")(text)
    assert text == ("@decorator\ndef f(a, b=1, *, x=None):  # é\n    '''doc'''\n    record(x)\n"
                    "    return g(a, b, x=True) + h.g(x=True)\n")
    assert ed.rename("g", "k", definition=False)(source).endswith("return k(a, b) + h.k()\n")
    with pytest.raises(nt.Unavailable):
        ed.replace_text("absent", "x")(source)
