"""A third-party guard and fix that spring, on purpose, the traps of docs/guides/writing-a-patch.md.

Both wrap ``_fsdp_common._get_dim0_padded_size(tensor_size, dim0_factor)`` (a pure function of every
FSDP2 release; torch's own callers hold it under their own names, so only a call through the module
reaches these wrappers: FSDP2 itself is untouched). What they do is chosen by :data:`MODE`, set by
the test's program (never by the environment):

* ``"guard"``: the guard raises its own ``GuardError``; ``"guard_from_fix"``: the fix does;
* ``"collective"``: the fix calls, through ``fsdp_autopatch.torch_call``, a c10d store wait that
  times out, as a collective of its own with a silent peer would;
* ``"undeclared"``: the fix reads an argument its ``Wrap.reads`` does not declare;
* ``""``: nothing; each wrapper records what its ``wrapped`` says it wraps (:data:`SEEN`).

The structural check uses only the public helpers (``fsdp_module``, ``fsdp_class``, ``class_attr``,
``innermost``, ``has_parameters``, ``reads_names``).
"""

import datetime

from fsdp_autopatch import (
    GuardError,
    Patch,
    Wrap,
    class_attr,
    fsdp_class,
    fsdp_module,
    has_parameters,
    innermost,
    needed,
    reads_names,
    torch_call,
    unsupported,
)

MODE = ""
SEEN = {}  # patch name -> what its wrapped's attributes said at its last call
RAISED = {}  # mode -> the exception object the wrapper raised (or torch_call's function raised)
_PATH = "torch.distributed.fsdp._fully_shard._fsdp_common:_get_dim0_padded_size"


def _check():
    function = innermost(getattr(fsdp_module("_fsdp_common"), "_get_dim0_padded_size", None))
    if not has_parameters(function, "tensor_size", "dim0_factor") or not reads_names(function, "ceil"):
        return unsupported("_get_dim0_padded_size(tensor_size, dim0_factor) not found")
    if not callable(class_attr(fsdp_class("_fsdp_param_group", "FSDPParamGroup"), "post_backward")):
        return unsupported("FSDPParamGroup.post_backward not found")
    return needed("_get_dim0_padded_size is there to wrap")


def _seen(name, wrapped):
    SEEN[name] = {
        "name": wrapped.__name__,
        "qualname": wrapped.__qualname__,
        "module": wrapped.__module__,
        "doc_is_torchs": wrapped.__doc__ == innermost(wrapped).__doc__,
        "wrapped_is_torchs": innermost(wrapped.__wrapped__) is innermost(wrapped),
    }


def _raise(mode, error):
    RAISED[mode] = error
    raise error


def _timed_out_collective():
    import torch.distributed as dist

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(milliseconds=200))
    try:
        store.wait(["a key no peer ever sets"])
    except Exception as error:
        _raise("collective", error)


def _stop(wrapped, instance, args, kwargs):
    _seen("traps_guard", wrapped)
    if MODE == "guard":
        message = "traps_guard: stopped on purpose; FSDP_AUTOPATCH_TRAPS_GUARD_ENABLED=0 lets the run go on"
        _raise("guard", GuardError("traps_guard", message))
    return wrapped(*args, **kwargs)


def _fix(wrapped, instance, args, kwargs):
    _seen("traps_fix", wrapped)
    if MODE == "guard_from_fix":
        _raise("guard_from_fix", GuardError("traps_fix", "traps_fix: stopped on purpose by a fix"))
    if MODE == "collective":
        torch_call(_timed_out_collective)
    if MODE == "undeclared":
        wrapped.argument("no_such_argument")
    factor = wrapped.argument("dim0_factor")  # declared: bound by name
    return wrapped.again(dim0_factor=factor)


_COMMON = dict(
    symptom="nothing goes wrong without it: a test distribution",
    trigger="a call of _fsdp_common._get_dim0_padded_size through its module",
    upstream=(),
    affected=">=2.6",
    check=_check,
)
FIX_PATCH = Patch(
    name="traps_fix",
    summary="a fix that raises a GuardError, calls a collective and reads an undeclared argument on request",
    targets=(Wrap(_PATH, _fix, reads=("dim0_factor",)),),
    changes="_get_dim0_padded_size is wrapped",
    **_COMMON,
)
GUARD_PATCH = Patch(
    name="traps_guard",
    summary="a guard that stops on request",
    targets=(Wrap(_PATH, _stop),),
    changes="_get_dim0_padded_size is guarded",
    kind="guard",
    **_COMMON,
)
