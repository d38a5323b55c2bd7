"""The catalogue: every fix, guard and policy by name, kind and toggle, in the order they apply.

A leaf: it imports nothing (not even the standard library), so the settings, the registry, the
CLI and the interpreter start-up path can know every entry without importing any patch code (the
patch modules import torch internals). What each entry does is declared once, in its module's
``PATCH`` (``fsdp_autopatch._spec.Patch``); ``tests/unit/test_catalogue.py`` checks that the two
agree (name, kind, toggle) and that this order respects every ``Patch.after``.

Adding a fix or a guard: one line below, in the place its ``after`` requires (usually the end of
its kind). Its toggle, ``FSDP_AUTOPATCH_<NAME>_ENABLED``, and its registry record follow from it.
"""

FIX = "fix"  # corrects torch where the bug strikes, changes nothing elsewhere; on by default
GUARD = "guard"  # stops, with a clear error, a run torch would silently train wrong; on by default
POLICY = "policy"  # changes a default, or adds a safety net; its own variable, recorded under "policies"
KINDS = (FIX, GUARD, POLICY)

PREFIX = "FSDP_AUTOPATCH_"
PACKAGE = "fsdp_autopatch.patches"
# An entry applies when torch's FSDP2 is imported, unless it wraps a module FSDP2 does not import
# (DCP's state_dict): it waits for that module (``Entry.waits_for``) and applies when it arrives.
DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"


def toggle_for(name):
    """A fix's or guard's switch, e.g. ``FSDP_AUTOPATCH_UNIFORM_REDUCE_DTYPE_ENABLED``."""
    return f"{PREFIX}{name.upper()}_ENABLED"


class Entry:
    """One entry of the catalogue (a plain class: this module is on the start-up path).

    name     -- the identifier: registry key, ``FSDP_AUTOPATCH_DISABLED`` item, ``demo --bug`` name
    kind     -- :data:`FIX`, :data:`GUARD` or :data:`POLICY`
    variable -- a policy's own switch; fixes and guards derive theirs from the name
    default  -- whether it is on when no variable says otherwise (fixes and guards: always)
    waits_for -- the module whose import applies it; None: FSDP2's (``_process.HOOK_TARGET``)
    kill_switch -- whether ``FSDP_AUTOPATCH_ENABLED=0`` turns a policy at its default off too (a
                 policy whose own variable is set follows that variable)
    """

    __slots__ = ("name", "kind", "variable", "default", "waits_for", "kill_switch")

    def __init__(self, name, kind=FIX, variable=None, default=True, waits_for=None, kill_switch=True):
        if kind not in KINDS:
            raise ValueError(f"{name}: kind {kind!r} is not one of {KINDS}")
        self.name = name
        self.kind = kind
        self.variable = variable
        self.default = default
        self.waits_for = waits_for
        self.kill_switch = kill_switch

    def __repr__(self):
        return f"Entry({self.name!r}, {self.kind!r})"

    @property
    def toggle(self):
        return self.variable or toggle_for(self.name)

    @property
    def module(self):
        """The module whose ``PATCH`` declares it."""
        return f"{PACKAGE}.{self.name}"


ENTRIES = (
    Entry("accumulated_grad_guard"),
    Entry("unused_param_reduction"),
    Entry("uniform_reduce_dtype"),
    Entry("restore_unused_param_grads"),  # after unused_param_reduction (Patch.after)
    Entry("post_forward_mesh_cache"),
    Entry("grouped_module_reuse"),
    Entry("keep_param_attributes"),
    Entry("clip_grad_norm_cpu_offload"),
    Entry("clip_grad_norm_multi_mesh"),  # after clip_grad_norm_cpu_offload (Patch.after)
    Entry("fsdp_module_abc_layout"),
    Entry("optimizer_unsharded_params_guard", GUARD),
    Entry("gradient_divide_factor_single_rank"),
    Entry("compiled_autograd_guard", GUARD),
    Entry("inplace_view_output"),
    Entry("stale_backward_recovery"),
    Entry("sac_prefetched_unit"),  # after stale_backward_recovery (Patch.after)
    Entry("dcp_optimizer_state_init", waits_for=DCP_STATE_DICT),
    Entry("inference_mode_first_forward"),
    Entry("unmanaged_trainable_params_guard", GUARD),
    Entry("peft_generate_forward_method"),
    Entry("frozen_first_mp_dtypes"),
    Entry("param_written_in_forward", GUARD),
    Entry("cast_inputs_keep_containers"),
    Entry("reshard_stale_unsharded"),
    Entry("param_post_accumulate_hooks"),
    Entry("param_grad_hooks_guard", GUARD),
    Entry("reduce_scatter_unused_params_default_on", POLICY, f"{PREFIX}REDUCE_SCATTER_UNUSED_PARAMS", default=False),
    # kill_switch=False: a rank whose plugin is switched off still checks, so that its peers learn it
    Entry("cross_rank_check", POLICY, f"{PREFIX}CROSS_RANK_CHECK", default=True, kill_switch=False),
    Entry("pending_grads_warning", POLICY, f"{PREFIX}PENDING_GRADS_WARNING", default=True),
    Entry("zero_grad_discards_pending_grads", POLICY, f"{PREFIX}ZERO_GRAD_DISCARDS_PENDING", default=False),
)
BY_NAME = {entry.name: entry for entry in ENTRIES}

FIXES = tuple(entry.name for entry in ENTRIES if entry.kind == FIX)
GUARDS = tuple(entry.name for entry in ENTRIES if entry.kind == GUARD)
POLICIES = tuple(entry.name for entry in ENTRIES if entry.kind == POLICY)
# The registry's per-patch records (status().patches), fixes and guards in the order they apply;
# policies are recorded under status().policies.
PATCH_NAMES = tuple(entry.name for entry in ENTRIES if entry.kind != POLICY)
# The modules other than FSDP2 whose import applies entries: the bootstrap arms a hook on each too.
WAITED_FOR = tuple(sorted({entry.waits_for for entry in ENTRIES if entry.waits_for}))
