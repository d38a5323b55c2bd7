"""compiled_autograd_guard: stop a backward that runs FSDP2's hooks under compiled autograd.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/compiled_autograd_guard.md.

Needed here?
    The root's ``_register_root_post_backward_final_callback`` queues its callback on the eager
    engine (``queue_callback``), both targets exist, and the only names of FSDP2's backward modules
    (``_fsdp_common``, ``_fsdp_state``, ``_fsdp_param_group``, ``_fsdp_param``: globals, and the
    targets' bytecode) that mention compiled autograd are none (2.12+) -> needed; those of its own
    path (``compiled_autograd_enabled``, ``detect_compiled_autograd``, ``_compiled_autograd_enabled``,
    with ``compiled_autograd_enabled`` callable; 2.6 - 2.11) -> not needed. Any other such name (a
    future traceable FSDP2) or a target missing -> unsupported.

The guard
    Wrappers of ``FSDPState._pre_backward`` (the first FSDP2 code a backward runs) and of
    ``FSDPParamGroup.post_backward`` (a second net) raise :class:`fsdp_autopatch.GuardError`
    before torch's method when they run inside a compiled-autograd graph: compiled autograd's
    module is loaded (read from ``sys.modules``, never imported here), its global
    ``in_compiled_autograd_region`` is set (by the runtime wrapper around the compiled graph), and
    this thread's stack holds a frame of that module (the flag is process-wide: a threaded process
    group whose other thread runs compiled autograd must not stop this one's eager backward).
    An FSDP2 with its own compiled-autograd path that chose it (``compiled_autograd_enabled()``
    True) is left to torch. Otherwise one dictionary lookup and one attribute read per hook.
    Under compiled autograd the hook is first reached while Dynamo traces the compiled-autograd graph (FSDP2's hooks are
    ``_dynamo_disable``d, our wrapper is not): the stack walk breaks that graph, the hook then runs
    eagerly and raises. Every rank of the job runs the same backward, so each raises in the same
    place: no rank is left waiting in a collective. A forward compiled with ``torch.compile`` and
    an eager backward (the usual setup), or compiled autograd configured but not engaged, stay
    silent.

Call-time isolation
    Our check runs before torch's method: should it raise anything but the guard's error, torch's
    method runs as without the patch. Nothing here is collective.
"""

from __future__ import annotations

import sys

from .. import _compat, _events
from .._catalogue import GUARD
from .._spec import Patch, Verdict, Wrap, needed, not_needed, unsupported

NAME = "compiled_autograd_guard"
_CA = "torch._dynamo.compiled_autograd"
_REGION = "in_compiled_autograd_region"
_BACKWARD_MODULES = ("_fsdp_common", "_fsdp_state", "_fsdp_param_group", "_fsdp_param")
_STATE = f"{_compat.FSDP2_PACKAGE}._fsdp_state"
_GROUP = f"{_compat.FSDP2_PACKAGE}._fsdp_param_group"
_FINAL_CALLBACK = "_register_root_post_backward_final_callback"
# What FSDP2 before PyTorch PR 174906 names its own compiled-autograd path by (PR 138187's cache).
_OWN_PATH = "compiled_autograd_enabled"
_OWN_PATH_NAMES = {_OWN_PATH, "detect_compiled_autograd", "_compiled_autograd_enabled"}
_MAX_DEPTH = 400  # frames walked up from a hook: the runtime wrapper is a few dozen above it

FOUND = (
    "backward() runs FSDP2's hooks inside a compiled-autograd graph (torch._dynamo.compiled_autograd), "
    "which this torch's FSDP2 does not support: its reshard and reduce-scatter after backward run from eager "
    "autograd hooks and a final callback queued on the eager autograd engine, which a compiled-autograd "
    "graph never runs, so the gradients would not be reduced across ranks and each rank's weights would "
    "silently drift from the others' (some units not trained at all)"
)
REMEDY = (
    "Run backward without compiled autograd: call backward() outside torch._dynamo.compiled_autograd._enable(...) "
    "and leave torch._dynamo.config.compiled_autograd off (torch.compile of the model's forward or of its "
    "blocks is fine, the backward then runs FSDP2's hooks eagerly)"
)


def _names_of_compiled_autograd(modules: list, targets: list) -> set[str]:
    """The names that mention compiled autograd among the modules' globals and the targets' bytecode."""
    names = {name for module in modules for name in vars(module) if "compiled_autograd" in name}
    for target in targets:
        names.update(name for name in getattr(_compat.code_of(target), "co_names", ()) if "compiled_autograd" in name)
    return names


def _structural_check() -> Verdict:
    modules = [_compat.fsdp_module(name) for name in _BACKWARD_MODULES]
    state, group = modules[1].FSDPState, modules[2].FSDPParamGroup
    targets = []
    for cls, method in ((state, "_pre_backward"), (state, _FINAL_CALLBACK), (group, "post_backward")):
        target = _compat.class_attr(cls, method)
        if not callable(target):
            return unsupported(f"{cls.__name__}.{method} is missing: torch left untouched")
        targets.append(target)
    if not _compat.reads_names(targets[1], "queue_callback"):
        return unsupported("the root no longer queues its final callback on the autograd engine: not measured")
    names = _names_of_compiled_autograd(modules, [targets[0], targets[2]])
    unknown = sorted(names - _OWN_PATH_NAMES)
    if unknown or (names and not callable(getattr(modules[0], _OWN_PATH, None))):
        return unsupported(
            f"this FSDP2 reads compiled autograd in a way not measured ({', '.join(unknown or sorted(names))}): "
            "torch left untouched"
        )
    eager = (
        "FSDP2's eager backward runs from hooks and a final callback queued on the eager autograd engine, "
        "which a compiled-autograd graph does not run"
    )
    if names:
        # measured on 2.8: around a plain backward, torch's own path raises ("queue_callback() is only
        # supported when Compiled Autograd is enabled with fullgraph=True"): the run stops, not silent
        return not_needed(
            f"FSDP2 has its own compiled-autograd path (_fsdp_common.{_OWN_PATH}()); around a plain backward "
            "torch raises itself instead of training silently wrong"
        )
    return needed(f"FSDP2 has no compiled-autograd path: {eager}")


def _fsdp2_took_its_own_path() -> bool:
    """An FSDP2 with its own compiled-autograd path (before PyTorch PR 174906) that chose it."""
    common = sys.modules.get(f"{_compat.FSDP2_PACKAGE}._fsdp_common")
    enabled = getattr(common, _OWN_PATH, None)
    return callable(enabled) and bool(enabled())


def in_compiled_autograd_graph() -> bool:
    """Whether this thread runs inside a compiled-autograd graph (never imports dynamo)."""
    ca = sys.modules.get(_CA)
    if ca is None or not getattr(ca, _REGION, False):
        return False
    # The flag is global to the process: confirm the runtime wrapper is on this thread's stack.
    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == _CA:
            return True
        frame = frame.f_back
    return False


def _stop_under_compiled_autograd(wrapped, instance, args, kwargs):
    if in_compiled_autograd_graph() and not _fsdp2_took_its_own_path():
        raise _events.stop(NAME, FOUND, REMEDY)
    return wrapped(*args, **kwargs)


PATCH = Patch(
    name=NAME,
    summary="a backward under compiled autograd stops at its first FSDP2 hook instead of skipping the reduce-scatter",
    symptom="silent: (almost) no reduce-scatter after the first backward, the ranks' weights drift from eager FSDP2's "
    "(torch 2.15 with bf16 parameters: its own grad_dtype RuntimeError at the first backward)",
    trigger="torch._dynamo.compiled_autograd around backward() (compiled_autograd._enable, or "
    "torch._dynamo.config.compiled_autograd with the backward inside a compiled function)",
    upstream=("torchtitan issue 1708", "PyTorch PR 174906", "PyTorch PR 174863",
              "NeMo Automodel compiled_autograd_active()"),
    # measured on 2.13 and 2.15; 2.14 read; 2.6 - 2.12 read, not run (the eager path, see the docstring)
    # 2.12 - 2.15 (no FSDP2 compiled-autograd path); before, FSDP2's own path raises (measured 2.8)
    affected=">=2.12,<2.16",
    check=_structural_check,
    targets=(
        Wrap(f"{_STATE}:FSDPState._pre_backward", _stop_under_compiled_autograd),
        Wrap(f"{_GROUP}:FSDPParamGroup.post_backward", _stop_under_compiled_autograd),
    ),
    changes="FSDP2's backward hooks stop with an error when they run inside a compiled-autograd graph",
    kind=GUARD,
)
