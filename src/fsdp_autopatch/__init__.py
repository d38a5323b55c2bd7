"""fsdp-autopatch: install and forget; every FSDP2 run in this environment gets its fixes.

``pip install fsdp-autopatch`` puts ``fsdp_autopatch.pth`` (and a PEP 829 ``fsdp_autopatch.start``)
into site-packages. At interpreter start it arms a cheap, stdlib-only trigger; when torch's FSDP2
(``torch.distributed.fsdp._fully_shard``) is imported, the patches below are applied, each one
switchable by an environment variable, and a registry records what happened:

.. generated: patches
* ``accumulated_grad_guard``             – a unit that never ran forward does not crash post-backward.
* ``unused_param_reduction``             – `FSDPModule.set_reduce_scatter_unused_params` on torch < 2.13.
* ``uniform_reduce_dtype``               – mixed-precision gradient accumulation does not trip "FSDP reduce-scatter
                                           expects uniform gradient dtype".
* ``restore_unused_param_grads``         – a parameter that no rank used keeps `grad is None`.
* ``post_forward_mesh_cache``            – units with the same mesh and an integer reshard_after_forward share one
                                           post-forward mesh.
* ``grouped_module_reuse``               – a grouped unit's module called again in the root's forward (MTP head) keeps
                                           its weights for backward.
* ``keep_param_attributes``              – attributes set on a parameter (`p.no_weight_decay = True`) are still there
                                           after `fully_shard`.
* ``clip_grad_norm_cpu_offload``         – clip_grad_norm_ works with CPUOffloadPolicy on an NCCL-only process group.
* ``clip_grad_norm_multi_mesh``          – clip_grad_norm_ works over gradients on several DeviceMeshes (experts +
                                           dense, HSDP + 1-D).
* ``fsdp_module_abc_layout``             – fully_shard works on a module class that lists abc.ABC first (`class
                                           Model(abc.ABC, nn.Module)`).
* ``optimizer_unsharded_params_guard``   – an optimizer holding FSDP2's unsharded parameters stops at its first step
                                           instead of never training them.
* ``gradient_divide_factor_single_rank`` – set_gradient_divide_factor divides once on a one-rank shard group (HSDP (N,
                                           1)) on the sum paths.
* ``compiled_autograd_guard``            – a backward under compiled autograd stops at its first FSDP2 hook instead of
                                           skipping the reduce-scatter.
* ``inplace_view_output``                – a unit's output view modified in place by the caller (`logits.div_(T)`) still
                                           unshards for backward.
* ``stale_backward_recovery``            – the step after a backward that raised trains as if its batch was never seen.
* ``sac_prefetched_unit``                – an FSDP2 unit unshard()ed or forward-prefetched before a
                                           selective-checkpointing region trains.
* ``dcp_optimizer_state_init``           – DCP's optimizer state dict has an entry for every trainable parameter and no
                                           dummy step (Adam, AdamW, SGD).
* ``inference_mode_first_forward``       – an evaluation under `torch.inference_mode()` before the first training step
                                           does not break training.
* ``unmanaged_trainable_params_guard``   – trainable parameters FSDP2 does not manage (adapters added after fully_shard)
                                           stop the first step where the ranks' copies differ.
* ``peft_generate_forward_method``       – `generate()` on a PEFT model that is FSDP2's root runs inside the root's
                                           pre-/post-forward.
* ``frozen_first_mp_dtypes``             – a unit frozen at the first forward and unfrozen later reduces in the
                                           mixed-precision reduce_dtype.
* ``param_written_in_forward``           – a forward that writes a managed parameter in place
                                           (nn.Embedding(max_norm=...)) stops at the reshard that would drop the write.
* ``cast_inputs_keep_containers``        – a list, dict or dataclass a unit is given and changes (aux losses appended,
                                           shared KV states) reaches its caller.
* ``reshard_stale_unsharded``            – a unit left unsharded across `optimizer.step()` is resharded, so the next
                                           forward uses the stepped weights.
* ``param_post_accumulate_hooks``        – post-accumulate-grad hooks registered before `fully_shard` (optimizer in
                                           backward) still run.
* ``param_grad_hooks_guard``             – a `Tensor.register_hook` hook on a parameter FSDP2 manages stops the first
                                           backward instead of never running.
.. end generated

Public API: :func:`install`, :func:`status`, :func:`applied`, :class:`PatchStatus`,
:class:`PatchRecord`, :class:`StatusReport`; for authors of patches shipped by other distributions
(entry-point group ``fsdp_autopatch.patches``): :class:`Patch`, :class:`Wrap` (with
:data:`KEEP_RESULT` / :data:`CALL_AGAIN`), :class:`Add`, :class:`Verdict`, :func:`needed`,
:func:`not_needed`, :func:`unsupported`, :func:`fired`; :class:`GuardError`, what a guard raises;
:func:`torch_call`, a collective of the patch's own whose errors reach the caller; for the
structural check, :func:`fsdp_module`, :func:`fsdp_class`, :func:`class_attr`, :func:`innermost`,
:func:`has_parameters`, :func:`reads_names`. Everything else is private.

Interpreter start does not import this package: the ``.pth`` imports only the top-level module
``_fsdp_autopatch_bootstrap``. This module still imports nothing heavy (the registry types are
loaded on first use): ``import fsdp_autopatch`` should cost a training script nothing.
"""

# ``__version__`` is loaded on first use too (``__getattr__`` below), so that
# ``import fsdp_autopatch`` loads this one module.

__all__ = [
    "Add",
    "CALL_AGAIN",
    "GuardError",
    "KEEP_RESULT",
    "Patch",
    "PatchRecord",
    "PatchStatus",
    "StatusReport",
    "Verdict",
    "Wrap",
    "__version__",
    "applied",
    "class_attr",
    "fired",
    "fsdp_class",
    "fsdp_module",
    "has_parameters",
    "innermost",
    "install",
    "needed",
    "not_needed",
    "reads_names",
    "status",
    "torch_call",
    "unsupported",
]

# public name -> the private module that defines it, imported on first use
_LAZY = {
    "PatchRecord": "_registry",
    "PatchStatus": "_registry",
    "StatusReport": "_registry",
    # for patch authors (docs/guides/writing-a-patch.md): the declaration and what its check returns
    "Patch": "_spec",
    "Wrap": "_spec",
    "Add": "_spec",
    "KEEP_RESULT": "_spec",
    "CALL_AGAIN": "_spec",
    "Verdict": "_spec",
    "needed": "_spec",
    "not_needed": "_spec",
    "unsupported": "_spec",
    "fired": "_events",
    "GuardError": "_events",
    "torch_call": "_isolation",
    # for a patch's structural check: torch's FSDP2 as it is, behind any wrappers
    "fsdp_module": "_compat",
    "fsdp_class": "_compat",
    "class_attr": "_compat",
    "innermost": "_compat",
    "has_parameters": "_compat",
    "reads_names": "_compat",
}


# No `typing` import at run time (``import fsdp_autopatch`` loads this one module): the names the
# annotations use are imported for type checkers only, and the annotations are strings.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._registry import StatusReport


def install() -> None:
    """Make sure the patches are (or will be) applied in this process; idempotent, never raises.

    Not needed after ``pip install``: the ``.pth`` file calls it at interpreter start. Call it
    yourself where ``site`` does not run (``python -S``, embedded interpreters). If torch's FSDP2 is
    already imported, the patches are applied right away; otherwise when it is imported.
    """
    import _fsdp_autopatch_bootstrap

    _fsdp_autopatch_bootstrap.install("explicit")


def status() -> "StatusReport":
    """A :class:`StatusReport`: per patch its name, status, reason and the variable that toggles it,
    plus torch's version and whether the bootstrap ran in this process."""
    from ._registry import REGISTRY

    return REGISTRY.snapshot()


def applied() -> "tuple[str, ...]":
    """Names of the patches applied in this process, in application order."""
    from ._registry import PatchStatus

    return tuple(record.name for record in status().patches if record.status is PatchStatus.APPLIED)


def __getattr__(name: str):
    if name == "__version__":
        from ._version import __version__

        return __version__
    # Plain relative imports, not importlib: this module is on the start-up path and stays
    # free of anything the interpreter did not load already.
    home = _LAZY.get(name)
    if home == "_registry":
        from . import _registry as module
    elif home == "_spec":
        from . import _spec as module
    elif home == "_events":
        from . import _events as module
    elif home == "_isolation":
        from . import _isolation as module
    elif home == "_compat":
        from . import _compat as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | {"__version__"})
