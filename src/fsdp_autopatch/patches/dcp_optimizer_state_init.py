"""dcp_optimizer_state_init: DCP's optimizer state template without a dummy step.

Symptom, trigger, torch versions, measurements and upstream: docs/patches/dcp_optimizer_state_init.md.

Needed here?
    ``state_dict._init_optim_state(optim)``'s source returns early on ``optim.state`` and calls
    ``optim.step(...)`` (the dummy step) -> needed. ``Adam._init_group`` (AdamW's too) binds a
    ``group`` and result lists only and holds the lazy initialisation of ``state["step"]``,
    ``exp_avg`` and ``exp_avg_sq``; ``SGD`` keeps ``momentum_buffer`` in its state -> needed.
    A torch without the dummy step -> not_needed (conclusive). Anything else -> unsupported.

The replacement
    A wrapper of ``_init_optim_state`` that acts only on ``torch.optim.Adam`` / ``AdamW`` (exactly
    these classes: amsgrad, foreach, fused and capturable included) and ``torch.optim.SGD`` with
    ``dampening`` 0. Each trainable parameter of the optimizer that has no state and no gradient
    gets what the optimizer's own lazy initialisation creates at its first step, without running
    a step:

    * Adam / AdamW: the optimizer's own ``_init_group`` runs over those parameters alone, each
      given a zero gradient for the call and ``None`` again after it: ``step`` 0 (its dtype and
      device by the optimizer's rule for fused / capturable), zero ``exp_avg`` / ``exp_avg_sq``
      (and ``max_exp_avg_sq`` with amsgrad). Nothing else of ``step()`` runs.
    * SGD with momentum: a zero ``momentum_buffer``. The first step's ``buf * momentum + grad``
      is then exactly the ``clone(grad)`` lazy initialisation gives (``dampening`` 0: with
      dampening the two differ, so torch's function runs). SGD without momentum keeps no state:
      nothing is created and no step runs.

    No counter advances, no weight decay fills a moment, no step hook fires, no parameter moves.
    The checkpoint then has an entry for every trainable parameter, and the template of a fresh
    optimizer equals it. A later real step finds the state and uses it exactly as the lazy
    initialisation would have (bitwise). Any other optimizer class, a parameter without state that
    has a gradient (mid-accumulation), or nothing to fill: torch's function, unchanged.

    ``fired``: once per call that created state (the number of parameters in ``where``).

When it applies
    DCP's state_dict module is imported on its own, before FSDP2, after it, or without it; the
    fix waits for that module (``Entry.waits_for``), not for FSDP2, and applies when it arrives.

Call-time isolation
    Our code runs before and instead of torch's function. Should it raise, the state it created
    is removed again and torch's function runs in its place (the bug's behaviour). No collective.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from typing import Any

from .. import _compat, _events
from .._catalogue import DCP_STATE_DICT
from .._spec import Patch, Verdict, Wrap, needed, not_needed, unsupported

NAME = "dcp_optimizer_state_init"
_FUNCTION = "_init_optim_state"
_ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")


def _returns_on_state_and_steps(source: str) -> tuple[bool, bool]:
    """(early return on ``<optim>.state``, a ``<optim>.step(...)`` call) in ``source``."""
    tree = ast.parse(textwrap.dedent(source))
    early_return = dummy_step = False
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Attribute) and node.test.attr == "state":
            early_return |= any(isinstance(statement, ast.Return) for statement in node.body)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step":
            dummy_step = True
    return early_return, dummy_step


def _adam_lazy_init_problem(torch: Any) -> str | None:
    """Why Adam's / AdamW's ``_init_group`` cannot be reused for the lazy state, or None."""
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        init_group = getattr(cls, "_init_group", None)
        if init_group is None:
            return f"{cls.__name__} has no _init_group"
        parameters = list(inspect.signature(init_group).parameters.values())
        if [p.name for p in parameters[:2]] != ["self", "group"] or any(
            p.default is not p.empty or p.kind is not p.POSITIONAL_OR_KEYWORD for p in parameters[2:]
        ):
            return f"{cls.__name__}._init_group does not take (group, <result lists>)"
        if not _compat.reads_names(init_group, "grad", "state", *_ADAM_STATE):
            return f"{cls.__name__}._init_group does not initialise {', '.join(_ADAM_STATE)} lazily"
    return None


def _structural_check() -> Verdict:
    import torch

    module = importlib.import_module(DCP_STATE_DICT)
    function = getattr(module, _FUNCTION, None)
    if function is None or not _compat.has_parameters(function, "optim"):
        return unsupported(f"{DCP_STATE_DICT} has no {_FUNCTION}(optim): torch left untouched")
    try:
        early_return, dummy_step = _returns_on_state_and_steps(inspect.getsource(_compat.innermost(function)))
    except (OSError, TypeError, SyntaxError):
        return unsupported(f"{_FUNCTION}'s source is not available: torch left untouched")
    if not dummy_step:
        return not_needed(f"{_FUNCTION} runs no dummy optimizer step", conclusive=True)
    if not early_return:
        return unsupported(f"{_FUNCTION} does not return early on optim.state: torch left untouched")
    problem = _adam_lazy_init_problem(torch)
    if problem is not None:
        return unsupported(f"{problem}: torch left untouched")
    if not _compat.reads_names(torch.optim.SGD.step, "momentum_buffer"):
        return unsupported("SGD.step keeps no momentum_buffer in its state: torch left untouched")
    return needed(f"{_FUNCTION} runs a dummy optimizer step, and only when the optimizer has no state at all")


def _handled(optim: Any, torch: Any) -> bool:
    """The optimizers whose lazy state this fix knows: exactly Adam, AdamW, and SGD without dampening."""
    if type(optim) in (torch.optim.Adam, torch.optim.AdamW):
        return True
    return type(optim) is torch.optim.SGD and all(group.get("dampening", 0) == 0 for group in optim.param_groups)


def _stateless(optim: Any) -> list[tuple[dict, list[Any]]] | None:
    """Per param group, its trainable parameters without optimizer state (None: one has a gradient)."""
    found = []
    for group in optim.param_groups:
        params = [p for p in group["params"] if p.requires_grad and len(optim.state.get(p, ())) == 0]
        if any(p.grad is not None for p in params):
            return None
        found.append((group, params))
    return found


def _init_adam_group(optim: Any, group: dict, params: list[Any], torch: Any) -> None:
    """Adam's own lazy initialisation for ``params``, each with a zero gradient for the call only."""
    lists = [[] for _ in list(inspect.signature(optim._init_group).parameters)[1:]]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        optim._init_group(dict(group, params=params), *lists)
    finally:
        for p in params:
            p.grad = None


def _init_sgd_group(optim: Any, group: dict, params: list[Any], torch: Any) -> None:
    if group.get("momentum", 0) == 0:
        return  # SGD without momentum keeps no state
    for p in params:
        optim.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _fill(optim: Any, stateless: list[tuple[dict, list[Any]]], torch: Any) -> int:
    """Create the lazy state; all or nothing. Returns how many parameters got state."""
    created = [p for _, params in stateless for p in params]
    init_group = _init_sgd_group if type(optim) is torch.optim.SGD else _init_adam_group
    try:
        for group, params in stateless:
            if params:
                init_group(optim, group, params, torch)
    except BaseException:
        for p in created:
            optim.state.pop(p, None)
        raise
    return sum(1 for p in created if len(optim.state.get(p, ())) > 0)


def _note_unhandled(optim: Any) -> None:
    """An optimizer this fix does not know (another class, a subclass, SGD with dampening) with a
    trainable parameter that has no state: say so once per class where logging is on, since
    torch's dummy step or the missing checkpoint entry stays."""
    if not any(p.requires_grad and not optim.state.get(p) for g in optim.param_groups for p in g["params"]):
        return  # every parameter has its state: torch returns early, nothing for the fix to do anyway
    cls = type(optim)
    _events.left_to_torch(
        NAME, f"{cls.__module__}.{cls.__qualname__}",
        f"{cls.__qualname__} is not exactly torch.optim.Adam, AdamW or SGD without dampening: torch's own "
        "function runs (a dummy optimizer step on an optimizer without state; no checkpoint entry for a "
        "parameter that never had a gradient)",
    )


def _init_lazy_state(wrapped, instance, args, kwargs):
    import torch

    optim = wrapped.argument("optim")
    if not _handled(optim, torch):
        _note_unhandled(optim)
        return wrapped(*args, **kwargs)
    stateless = _stateless(optim)
    if stateless is None or not any(params for _, params in stateless):
        return wrapped(*args, **kwargs)
    had_state = len(optim.state) > 0
    count = _fill(optim, stateless, torch)
    if count:
        without = (
            f"no optimizer state for {count} trainable parameter(s): the checkpoint lacks their entries "
            "and a fresh optimizer's template expects them (Missing key at resume)"
            if had_state
            else "a dummy optimizer step: Adam's step 1 (the first real update mis-sized), coupled weight "
            "decay in the moments or an SGD momentum buffer of wd * p, the step hooks run"
        )
        _events.fired(NAME, without, f"{type(optim).__name__}, {count} parameter(s) given their lazy state")
    return None


PATCH = Patch(
    name=NAME,
    summary="DCP's optimizer state dict has an entry for every trainable parameter and no dummy step "
    "(Adam, AdamW, SGD)",
    symptom="RuntimeError: Missing key in checkpoint state_dict: optim.state.<param>.step; silently, a step-0 "
    "checkpoint records Adam's step 1 (the first AdamW update 0.745x its size)",
    trigger="dcp.save / dcp.load with get_state_dict or set_state_dict and a trainable parameter that never had a "
    "gradient (unused expert, unused-param fill), or a checkpoint before the first optimizer.step()",
    upstream=("PyTorch issue 192202", "PyTorch issue 164929", "NeMo Automodel PRs 2071, 2779", "prime-rl PR 2800",
              "torchtitan PR 4382"),
    # 2.13 and 2.15 measured; 2.6 - 2.12 read (the same early return and dummy step); <2.16: the
    # end of what was measured (still there on 2.15), not a fix.
    affected=">=2.6,<2.16",
    check=_structural_check,
    targets=(Wrap(f"{DCP_STATE_DICT}:{_FUNCTION}", _init_lazy_state, reads=("optim",)),),
    changes="trainable parameters without state get the optimizer's own lazy state, and no dummy step runs",
)
