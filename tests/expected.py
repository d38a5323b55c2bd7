"""What fsdp-autopatch must do on each torch release: the single source of truth for the tests
and for the compatibility matrix (``scripts/matrix.py``).

Stdlib only, so the matrix runner can read it without torch. The facts come from the wheel
sources and from measurement (``docs/compatibility.md``, "The measured matrix"):

========  ===========  ================  ===========  =================================
torch     bug (a)      set_reduce_...    bug (c)      gloo FSDP2 on CPU
========  ===========  ================  ===========  =================================
2.6       latent       missing           yes          no (gloo lacks ReduceOp.AVG)
2.7       crashes      missing           yes          no
2.8-2.12  crashes      missing           yes          yes
2.13-2.14 crashes      torch's own       yes          yes
2.15      gone         torch's own       gone         yes
========  ===========  ================  ===========  =================================

A release outside 2.6 - 2.15 (2.16 the day it is on PyPI, a nightly) has no expectations here:
``expected_status`` and ``unpatched_outcome`` answer :data:`NOT_MEASURED` for each patch and bug
instead of inventing one, because there the plugin's structural checks decide alone
(``_compat.MEASURED_RELEASES``). :func:`claimed_by` turns the plugin's own verdicts on such a torch
into what the tests then check (what the structural check says is what must happen), and
``scripts/matrix.py`` reports the release as a first measurement. Once a release is measured and
reviewed, add it to :data:`MEASURED` and to the functions below.
"""

from __future__ import annotations

PATCHES = (
    "accumulated_grad_guard",
    "unused_param_reduction",
    "uniform_reduce_dtype",
    "restore_unused_param_grads",
    "post_forward_mesh_cache",
    "grouped_module_reuse",
    "keep_param_attributes",
    "clip_grad_norm_cpu_offload",  # its case needs CUDA and NCCL (NEEDS); before clip_grad_norm_multi_mesh (after)
    "clip_grad_norm_multi_mesh",
    "fsdp_module_abc_layout",
    "optimizer_unsharded_params_guard",  # a guard (kind GUARD)
    "gradient_divide_factor_single_rank",
    "compiled_autograd_guard",  # a guard (kind GUARD)
    "inplace_view_output",
    "stale_backward_recovery",
    "sac_prefetched_unit",
    "dcp_optimizer_state_init",  # waits for torch.distributed.checkpoint.state_dict (Entry.waits_for)
    "inference_mode_first_forward",
    "unmanaged_trainable_params_guard",  # a guard (kind GUARD)
    "peft_generate_forward_method",
    "frozen_first_mp_dtypes",
    "param_written_in_forward",  # a guard (kind GUARD)
    "cast_inputs_keep_containers",
    "reshard_stale_unsharded",
    "param_post_accumulate_hooks",
    "param_grad_hooks_guard",  # a guard (kind GUARD)
)
# The bug each patch exists for, as the docs and the matrix table name them.
BUG_OF = {
    "accumulated_grad_guard": "a",
    "unused_param_reduction": "b",
    "uniform_reduce_dtype": "c",
    "restore_unused_param_grads": "d",
    "post_forward_mesh_cache": "e",
    "grouped_module_reuse": "f",
    "keep_param_attributes": "g",
    "clip_grad_norm_multi_mesh": "h",
    "fsdp_module_abc_layout": "i",
    "optimizer_unsharded_params_guard": "k",  # PyTorch issue 149205
    "gradient_divide_factor_single_rank": "j",  # PyTorch issue 155903
    "compiled_autograd_guard": "l",  # torchtitan issue 1708
    "inplace_view_output": "m",  # PyTorch issue 181832
    "stale_backward_recovery": "n",  # torchtitan issue 1329, composer PR 3866 (no upstream issue)
    "sac_prefetched_unit": "o",  # NeMo Automodel issue 3958, torchtitan issue 3427
    "dcp_optimizer_state_init": "p",  # PyTorch issues 192202, 164929
    "inference_mode_first_forward": "q",  # no upstream issue; PyTorch PR 197327 fixed another crash
    "unmanaged_trainable_params_guard": "r",  # transformers PR 48792, FastVideo PR 1666
    "clip_grad_norm_cpu_offload": "u",  # NeMo Automodel PR 3461, torchtune PR 2108, axolotl issue 3058
    "peft_generate_forward_method": "t",  # TRL issue 4550
    "frozen_first_mp_dtypes": "y",  # PyTorch issue 186998 (PR 187376)
    "param_written_in_forward": "z",  # no upstream issue (nn.Embedding max_norm under FSDP2)
    "cast_inputs_keep_containers": "x",  # transformers issue 45663 (and PRs 45716 / 45912), verl PR 7657
    "reshard_stale_unsharded": "v",  # Robbyant/lingbot-vla PR 50; PyTorch PR 137348 (the same for prefetches)
    "param_post_accumulate_hooks": "w",  # PyTorch PR 129450 runs only the sharded parameter's hooks
    "param_grad_hooks_guard": "s",  # torchrec PRs 4268 / 4253
}

# The entries applied when another module than FSDP2 is imported (the catalogue's ``Entry.waits_for``;
# tests/unit/test_catalogue.py checks they agree): pending until that module is imported.
WAITS_FOR = {"dcp_optimizer_state_init": "torch.distributed.checkpoint.state_dict"}

OLDEST_RUNNABLE = (2, 8)  # FSDP2 on gloo needs ReduceOp.AVG (torch >= 2.8)

# The releases this file knows, oldest first: every one measured by scripts/matrix.py
# (docs/compatibility.md). The same range as ``_compat.MEASURED_RELEASES`` (>=2.6,<2.16).
MEASURED = tuple((2, minor) for minor in range(6, 16))

# The expectation for a patch or a bug on a release outside MEASURED: none, the plugin's
# structural check decides there and the matrix reports what it measured as a first measurement.
NOT_MEASURED = "not measured: the structural check decides"
# Registry statuses that are wrong on every release, measured or not, once FSDP2 is imported with
# the defaults: one of our modules raised ("failed"), or the import hook never ran ("pending").
ALWAYS_WRONG = ("failed", "pending")

# What a test run without the plugin shows, per bug. The matrix records the measured outcome
# next to this expectation.
REPRODUCES = "reproduces"
FIXED = "correct without the plugin"
NOT_APPLICABLE = "n/a"


def release_of(version: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; pre-releases and local parts count as their release."""
    major, minor = version.split("+")[0].split(".")[:2]
    digits = "".join(ch for ch in minor if ch.isdigit()) or "0"
    return int(major), int(digits)


def is_measured(release: tuple[int, int]) -> bool:
    """Whether this file holds measured expectations for ``release`` (2.6 - 2.15)."""
    return tuple(release) in MEASURED


def release_text(release: tuple[int, int]) -> str:
    return ".".join(map(str, release))


def expected_status(release: tuple[int, int]) -> dict[str, str]:
    """The registry status of each patch after ``import torch.distributed.fsdp`` and
    ``import torch.distributed.checkpoint.state_dict`` (what ``dcp_optimizer_state_init`` waits
    for: pending until then), defaults on;
    :data:`NOT_MEASURED` for each patch on a release outside :data:`MEASURED`."""
    if not is_measured(release):
        return dict.fromkeys(PATCHES, NOT_MEASURED)
    return {
        # the crash path exists up to 2.14 (latent on 2.6, where the guard is harmless)
        "accumulated_grad_guard": "applied" if release < (2, 15) else "not_needed",
        # torch 2.13 added FSDPModule.set_reduce_scatter_unused_params itself
        "unused_param_reduction": "applied" if release < (2, 13) else "not_needed",
        # 2.15 removed the uniform-dtype assertion from foreach_reduce
        "uniform_reduce_dtype": "applied" if release < (2, 15) else "not_needed",
        # the fill exists everywhere: torch's own from 2.13, the backport before
        "restore_unused_param_grads": "applied",
        # _get_post_forward_mesh_info builds a DeviceMesh per call in every release 2.6 - 2.15
        "post_forward_mesh_cache": "applied",
        # the root's force-complete of a partial group (PyTorch PR 180428) arrived in 2.13
        "grouped_module_reuse": "applied" if release >= (2, 13) else "not_needed",
        # every FSDP2 release installs new Parameters without the replaced one's __dict__
        "keep_param_attributes": "applied",
        # (u) _get_total_norm reduces partial norms where the gradients live: measured 2.13 (CPU stand-in);
        # read, not run, 2.8 - 2.12, 2.14, 2.15 (the same _get_total_norm)
        "clip_grad_norm_cpu_offload": "applied",
        # clip_grad's _get_total_norm stacks per-tensor norms without regard to DeviceMesh (2.8 - 2.15)
        "clip_grad_norm_multi_mesh": "applied",
        # every FSDP2 release builds type("FSDP<Name>", (FSDPModule, cls)) and caches it in cls_to_fsdp_cls
        "fsdp_module_abc_layout": "applied",
        "optimizer_unsharded_params_guard": "applied",  # root unsharded after forward: measured 2.13/2.15, read 2.6+
        # (j) the one-rank copy divides by the factor: measured 2.10 - 2.13, 2.15; absent on 2.8, 2.9 (measured)
        "gradient_divide_factor_single_rank": "applied" if release >= (2, 10) else "not_needed",
        # (l) FSDP2 without a compiled-autograd path of its own (2.12 on, PyTorch PR 174906): measured
        # 2.13/2.15; with one (2.8 measured; 2.9 - 2.11 read, not run) torch raises itself: not needed
        "compiled_autograd_guard": "applied" if release >= (2, 12) else "not_needed",
        "inplace_view_output": "applied",  # (m) a tensor hook per output: measured 2.13/2.15, read 2.6-2.12
        # (n) measured 2.13/2.15, 2.14 not run; < 2.13: no FSDPState._reset_iter_state to recover with
        "stale_backward_recovery": "applied" if release >= (2, 13) else "unsupported",
        # (o) measured 2.13/2.15, 2.14 not read; < 2.13: FIFO-replay SAC (read 2.8.0; 2.9-2.12 not read)
        "sac_prefetched_unit": "applied" if release >= (2, 13) else "unsupported",
        # (p) _init_optim_state's early return and dummy step: measured 2.13, 2.15; read 2.6 - 2.12
        "dcp_optimizer_state_init": "applied",
        # (q) buffers created in the first unshard's mode: measured 2.13/2.15; read, not run, 2.6-2.12, 2.14
        "inference_mode_first_forward": "applied",
        # (r) fully_shard manages what it saw: measured 2.13, 2.15; read 2.6 - 2.12, 2.14
        "unmanaged_trainable_params_guard": "applied",
        # (t) FSDP2 runs its hooks around forward only: measured 2.13; read 2.14.1, 2.15.0; 2.6 - 2.12 the same
        # register_fsdp_forward_method (PR 125394, 2.4), not read: the matrix measures the check there
        "peft_generate_forward_method": "applied",
        # (y) _init_mp_dtypes takes the dtypes from the trainable parameters only: measured 2.13 (applied) and
        # 2.15 (not_needed: the floating parameters decide, PyTorch PR 187376); read 2.14.1 (the same fix:
        # not_needed); 2.8 - 2.12 inferred (the requires_grad filter came with PyTorch PR 154103, 2.8);
        # 2.6 / 2.7 inferred (every parameter's dtype: nothing to fix)
        "frozen_first_mp_dtypes": "applied" if (2, 8) <= release < (2, 14) else "not_needed",
        # (z) wait_for_unshard / reshard never write the unsharded copy back: measured 2.13, 2.15; read 2.14.1;
        # 2.6 - 2.12 inferred (the same two methods since FSDP2's first releases)
        "param_written_in_forward": "applied",
        # (x) _pre_forward's cast walk rebuilds every container: measured 2.13, 2.15; read, not run, 2.14 and
        # 2.8 - 2.12 (the same _apply_to_tensors, called in _pre_forward itself before _cast_forward_inputs)
        "cast_inputs_keep_containers": "applied",
        # (v) unshard's early return on an unsharded group: measured 2.13, 2.15; read 2.14; 2.6 - 2.12 inferred
        "reshard_stale_unsharded": "applied",
        # (w) _init_sharded_param builds a new Parameter, foreach_reduce runs only its hooks (PyTorch PR 129450,
        # 2.5): measured 2.13, 2.15; read, not run, 2.8 - 2.12 (the same loop, skipped under compiled autograd)
        # and 2.14
        "param_post_accumulate_hooks": "applied",
        # (s) no FSDP2 release runs a parameter's register_hook hooks: measured 2.13, 2.15; read 2.8 - 2.12, 2.14
        "param_grad_hooks_guard": "applied",
    }


def unpatched_outcome(release: tuple[int, int]) -> dict[str, str]:
    """What each bug's scenario gives with that bug's patch disabled (the others stay on).

    (a) and (c): the upstream crash / assertion, until 2.15 removed both code paths.
    (b): the patch exists to provide ``set_reduce_scatter_unused_params``; without it the call
    fails before 2.13 (and ranks that use different experts mix their gradients), while from
    2.13 torch's own method gives the right gradients.
    (d): any unused-param fill, torch's own (>= 2.13) or the plugin's backport (< 2.13), turns
    a never-used parameter's ``None`` into a zero gradient that AdamW then applies.

    :data:`NOT_MEASURED` for each bug on a release outside :data:`MEASURED` (see :func:`claimed_by`).
    """
    if not is_measured(release):
        return dict.fromkeys(BUG_OF.values(), NOT_MEASURED)
    return {
        "a": REPRODUCES if (2, 7) <= release < (2, 15) else FIXED,
        "b": REPRODUCES if release < (2, 13) else FIXED,
        "c": REPRODUCES if release < (2, 15) else FIXED,
        "d": REPRODUCES,
        # (e) measured on every release 2.8 - 2.15 (4 gloo ranks, k=2: 8 units -> 16 process groups,
        # 16 -> 32); read, not run: the same function in the 2.6 and 2.7 wheels
        "e": REPRODUCES,
        # (f) measured: fails on 2.13 - 2.15, right on 2.8 - 2.12 (no force-complete); 2.6 / 2.7
        # predate it
        "f": REPRODUCES if release >= (2, 13) else FIXED,
        # (g) measured on every release 2.8 - 2.15 (every attribute lost at fully_shard)
        "g": REPRODUCES,
        # (h) measured on every release 2.8 - 2.15 (2 gloo ranks, ("dp",) + ("edp",) meshes: the
        # stack refuses two meshes; 2.9 words it as a failed sharding propagation)
        "h": REPRODUCES,
        # (i) measured on 2.13 and 2.15 (TypeError at the first fully_shard of an ABC-first class);
        # read, not run, on 2.6 - 2.12: the same class swap (CPython's layout rule, any Python)
        "i": REPRODUCES,
        "k": REPRODUCES,  # (k) measured 2.13, 2.15: the root's head never moves in 3 SGD steps; read 2.6-2.12, 2.14
        # (j) measured 2.10 - 2.13, 2.15 (grads / f**2: |ref|/|grad| 4.0000 fp32, 3.9996 fp16); right on 2.8, 2.9
        "j": REPRODUCES if release >= (2, 10) else FIXED,
        # (l) measured 2.13, 2.15 (silent drift); 2.8: torch's own CA path raises (queue_callback ...
        # fullgraph=True); 2.9 - 2.11 read, not run; 2.12 read (no CA path since PR 174906)
        "l": REPRODUCES if release >= (2, 12) else FIXED,
        "m": REPRODUCES,  # (m) measured 2.13, 2.15 (setStorage: view + mul_); read, not run, 2.6-2.12; 2.14 inferred
        # (n) measured 2.13, 2.15 (0 of 6 grads after a failed backward); before 2.13 the patch is
        # unsupported (no FSDPState._reset_iter_state): it claims nothing there, the matrix records
        "n": REPRODUCES if release >= (2, 13) else NOT_MEASURED,
        # (o) measured 2.13, 2.15 (invocation index 2 / 3 on every rank); 2.14 not run. Before 2.13 the
        # patch is unsupported (FIFO-replay SAC) and claims nothing: 2.8.0 measured right for these
        # cases (docs/troubleshooting.md), 2.9 - 2.12 not run
        "o": REPRODUCES if release >= (2, 13) else NOT_MEASURED,
        # (p) measured 2.13, 2.15 (Missing key ... optim.state.<param>.step at dcp.load; a step-0
        # checkpoint's Adam step 1); read, not run, 2.6 - 2.12 (the same _init_optim_state)
        "p": REPRODUCES,
        # (q) measured 2.13, 2.15 (the first training step after an inference_mode evaluation raises:
        # in-place update to an inference tensor); read, not run, 2.8 - 2.12 and 2.14 (the same methods)
        "q": REPRODUCES,
        # (r) measured 2.13, 2.15 (the ranks' adapters apart after 3 SGD steps, silently); read 2.8 - 2.12, 2.14
        "r": REPRODUCES,
        # (u) measured 2.13 with a CPU stand-in (2 gloo ranks, a group that serves cuda only: "No backend type
        # associated with device type cpu" on every rank); on CUDA with NCCL read, not run (its case, NEEDS cuda:
        # the GPU check's); read, not run, 2.8 - 2.12, 2.14, 2.15 (the same _get_total_norm)
        "u": REPRODUCES,
        # (t) measured 2.13 (peft 0.21, transformers 5.25: the mixed Tensor / DTensor error at the first op on the
        # root's parameters, before and after the first step); not a torch change: any FSDP2 release alike
        "t": REPRODUCES,
        # (y) measured 2.13 (the grad_dtype RuntimeError at the first backward after unfreezing) and 2.15
        # (right: bf16-close to the fp32 reference); read 2.14.1 (torch's fix); 2.8 - 2.12 inferred (PR 154103's
        # requires_grad filter; the issue's "to a tensor with dtype 'float'" wording); 2.6 / 2.7 inferred right
        "y": REPRODUCES if (2, 8) <= release < (2, 14) else FIXED,
        # (z) measured 2.13, 2.15 (the embedding's renormalized rows dropped at reshard, silently); read 2.14.1;
        # 2.8 - 2.12 inferred (FSDP2 has never written an unsharded parameter back)
        "z": REPRODUCES,
        # (x) measured 2.13, 2.15 (0 of 3 auxiliary losses reach the caller; KeyError for the shared dict); read,
        # not run, 2.8 - 2.12 and 2.14 (the same walk: _apply_to_tensors rebuilds every list, dict, dataclass)
        "x": REPRODUCES,
        # (v) measured 2.13, 2.15 (the clip sees 0 of 6 gradients, the weights off the reference after 3 steps);
        # read, not run, 2.14 (the same early return in FSDPParamGroup.unshard); 2.8 - 2.12 inferred, not read
        "v": REPRODUCES,
        # (w) measured 2.13, 2.15 (the hooks run 0 of 18 times, the weights never move: 8.9e-01 relative from
        # the reference); read, not run, 2.8 - 2.12 and 2.14 (the same parameter swap and foreach_reduce loop)
        "w": REPRODUCES,
        # (s) measured 2.13, 2.15 (the clamps run 0 of 3 times each: weights 6.0e-01 relative from the
        # reference); read, not run, 2.8 - 2.12 and 2.14
        "s": REPRODUCES,
    }



# --- the cases: each entry's smallest training (``fsdp_autopatch.cases.<entry>``) ------------------
# test_dist_cases.py runs every case on gloo ranks with its entry off and with the plugin as
# installed, and judges the raw record (never the case's own verdict) against these rows, with the
# tests' own tolerances, and against the case's one-process reference. A row's keys, each optional:
#   "error":  None (the run completed), or how ``"Type: message"`` starts (a tuple: any of them);
#   "grads", "params": REFERENCE / BF16 (within fp32 / bf16 tolerance of the reference's), WRONG (not
#             within fp32 tolerance: a silent wrong value);
#   "values": {key: what the record's values[key] must equal}.
# "on" is checked with the plugin as installed; "off" where ``unpatched_outcome`` says the bug
# reproduces (where it says fixed, the off run must meet "on" instead).
REFERENCE, BF16, WRONG = "reference", "bf16", "wrong"
COMPLETED = {"error": None}
CASE_ROW_KEYS = ("error", "grads", "params", "values")


def check_case_row(row) -> list:
    """What is wrong with one ``case_rows`` row (an empty list where nothing is): an unknown key (a
    typo would check nothing), a row that checks nothing, a tolerance that is not one of the three."""
    if not isinstance(row, dict) or not row:
        return [f"a row is a non-empty dict of {', '.join(CASE_ROW_KEYS)}, not {row!r}"]
    problems = [f"unknown key {key!r} (known: {', '.join(CASE_ROW_KEYS)})" for key in row if key not in CASE_ROW_KEYS]
    for key in ("grads", "params"):
        if key in row and row[key] not in (REFERENCE, BF16, WRONG):
            problems.append(f"{key}: {row[key]!r} is none of REFERENCE, BF16, WRONG")
    if "values" in row and (not isinstance(row["values"], dict) or not row["values"]):
        problems.append(f"values: a non-empty dict of what the record's values must equal, not {row['values']!r}")
    if "error" in row and not (row["error"] is None or isinstance(row["error"], (str, tuple))):
        problems.append(f"error: None, a string or a tuple of strings, not {row['error']!r}")
    return problems


def case_rows(release: tuple[int, int]) -> dict[str, dict[str, dict]]:
    """Per entry, what its case records ``"on"`` and ``"off"`` on ``release``."""
    return {
        # (e) 8 units, k=2, 4 ranks: 2 process groups per unit without the patch, one shared mesh with it
        "post_forward_mesh_cache": {
            "on": {**COMPLETED, "grads": REFERENCE, "values": {"process_groups": 2}},
            "off": {**COMPLETED, "grads": REFERENCE, "values": {"process_groups": 16}},
        },
        # (m) the backward meets the resized-away unsharded storage
        "inplace_view_output": {
            "on": {**COMPLETED, "grads": REFERENCE},
            "off": {"error": "RuntimeError: setStorage: "},
        },
        # (a) the side unit skipped the first no-sync micro-batch: the crash there on every rank (measured
        # 2.13; the same message 2.7 - 2.14, as the old test read it); 2.15 has no such path: off meets "on"
        "accumulated_grad_guard": {
            "on": {**COMPLETED, "grads": BF16},
            "off": {"error": "AttributeError: 'FSDPParam' object has no attribute '_unsharded_param'"},
        },
        # (b) before 2.13 the method the case calls is missing without the backport (the message measured on
        # 2.13 with torch's method deleted); from 2.13 torch's own method: off meets "on" (measured 2.13)
        "unused_param_reduction": {
            "on": {**COMPLETED, "grads": REFERENCE},
            "off": {"error": ("AttributeError: 'FSDPExperts' object has no attribute "
                              "'set_reduce_scatter_unused_params'")},
        },
        # (c) b's first (bf16) gradient next to a's fp32 accumulation: the assertion on every rank (the set
        # in hash order; measured 2.13, the same text 2.8 - 2.14); 2.15 removed it: off meets "on"
        "uniform_reduce_dtype": {
            "on": {**COMPLETED, "grads": BF16},
            "off": {"error": "AssertionError: FSDP reduce-scatter expects uniform gradient dtype but got "},
        },
        # (d) expert 2, used by no rank: the fill's zero grad, which AdamW's weight decay moves (3.4e-4 on
        # 2.13), without the patch; None and bitwise unchanged with it (any fill: 2.8 - 2.15)
        "restore_unused_param_grads": {
            "on": {**COMPLETED, "grads": REFERENCE,
                   "values": {"unused_grad_is_none": True, "unused_unchanged": True, "unused_moved_by": 0.0}},
            "off": {**COMPLETED, "grads": REFERENCE,
                    "values": {"unused_grad_is_none": False, "unused_unchanged": False}},
        },
        # (f) the head's second call meets its freed unsharded storage in backward: measured 2.13 here,
        # the old test's 2.13 - 2.15; on 2.8 - 2.12 the off run is right (no force-complete)
        "grouped_module_reuse": {
            "on": {**COMPLETED, "grads": REFERENCE},
            "off": {"error": "RuntimeError: setStorage: sizes [4, 8], strides [8, 1]"},
        },
        # (g) every attribute lost at fully_shard, so AdamW decays the no_weight_decay parameters too
        "keep_param_attributes": {
            "on": {**COMPLETED, "params": REFERENCE, "values": {"attributes": [
                "0.bias.no_weight_decay", "1.bias.no_weight_decay", "1.weight.no_weight_decay",
                "2.bias.no_weight_decay", "2.weight.tag"]}},
            "off": {**COMPLETED, "params": WRONG, "values": {"attributes": []}},
        },
        # (h) the stack of per-mesh norms refuses two meshes: ValueError on 2.8, 2.9 words it as a failed
        # propagation, RuntimeError 2.10 - 2.15 (measured 2.13 here). The clipped grads equal the
        # one-process clip's only where the total norm does (the float itself is not compared)
        "clip_grad_norm_multi_mesh": {
            "on": {**COMPLETED, "grads": REFERENCE},
            "off": {"error": ("RuntimeError: All operands in aten.stack.default must have the same mesh",
                              "ValueError: All operands in aten.stack.default must have the same mesh",
                              "RuntimeError: Sharding propagation failed for Op(op=aten.stack.default")},
        },
        # (u) CPUOffloadPolicy on NCCL (the GPU check's: NEEDS cuda, skipped on gloo): the partial norms'
        # all-reduce of CPU tensors on a group with no CPU backend; with the fix the one-process clip's total
        # and clipped grads, the total a replicated DTensor on the CPU. Read, not run (no GPU here); the same
        # error measured with the CPU stand-in (test_dist_clip_grad_norm_cpu_offload.py)
        "clip_grad_norm_cpu_offload": {
            "on": {**COMPLETED, "grads": REFERENCE, "values": {"total_on": "cpu", "total_replicated": True}},
            "off": {"error": "RuntimeError: No backend type associated with device type cpu"},
        },
        # (i) the class swap of the ABC-first root fails at its fully_shard; with the patch torch's class order
        "fsdp_module_abc_layout": {
            "on": {**COMPLETED, "grads": REFERENCE, "values": {"mro": ["FSDPTanhModel", "FSDPModule", "TanhModel"]}},
            "off": {"error": "TypeError: __class__ assignment: 'FSDPTanhModel' object layout differs from 'TanhModel'"},
        },
        # (k) the optimizer holds the root's unsharded head: it never moves, the weights are off the reference
        # (measured 2.13: moved 0.0, relative |weight - reference| 1.5; the old test: 2.8 - 2.15 alike)
        "optimizer_unsharded_params_guard": {
            "on": {"error": "GuardError: fsdp-autopatch guard optimizer_unsharded_params_guard: SGD holds 2 FSDP2 "
                            "unsharded parameter(s)"},
            "off": {**COMPLETED, "params": WRONG, "values": {"head_moved": False, "optimizer_holds_head": False}},
        },
        # (j) the one-rank copy divides by the factor once more: |reference|/|grad| = 4.0000 (measured 2.13);
        # 2.8 / 2.9 have no dividing copy: right without the patch (unpatched_outcome)
        "gradient_divide_factor_single_rank": {
            "on": {**COMPLETED, "grads": REFERENCE},
            "off": {**COMPLETED, "grads": WRONG},
        },
        # (l) 2.12+: silent drift, the first layer never trains (measured 2.13: relative |weight - eager
        # reference| 5.2e-01; the old test: 2.15 alike). Before 2.12 FSDP2's own compiled-autograd path makes
        # torch raise itself, guard or not (measured 2.8 - 2.11 by the matrix): "on", and the off run meets it
        "compiled_autograd_guard": {
            "on": {"error": "GuardError: fsdp-autopatch guard compiled_autograd_guard: backward() runs FSDP2's "
                            "hooks inside a compiled-autograd graph"} if release >= (2, 12) else
                  {"error": "AssertionError: queue_callback() is only supported when Compiled Autograd is enabled"},
            "off": {**COMPLETED, "params": WRONG, "values": {"first_weight_moved": False}},
        },
        # (n) after the caught failed backward no sharded param gets a grad: 0 and 0 of 6, the weights never
        # move (measured 2.13; the old test: 2.15 alike); before 2.13 the entry is unsupported
        "stale_backward_recovery": {
            "on": {**COMPLETED, "params": REFERENCE, "values": {"with_grad": [6, 6]}},
            "off": {**COMPLETED, "params": WRONG, "values": {"with_grad": [0, 0]}},
        },
        # (o) l1.unshard() before the SAC region: the recompute misses a profiler op (index 2 on 2.13, 2 / 3
        # on 2.15 in the old scenarios); before 2.13 the patch is unsupported and the "on" test skips
        "sac_prefetched_unit": {
            "on": {**COMPLETED, "grads": REFERENCE},
            "off": {"error": "RuntimeError: profiler._record_function_enter_new.default invocation index "},
        },
        # (p) spare never had a gradient: dcp.load misses its AdamW step (measured 2.13, the old test's
        # message on 2.15; the case raises the first failing rank's error out of DCP's CheckpointException);
        # with the patch the resume loads the saved weights and spare's step is 0
        "dcp_optimizer_state_init": {
            "on": {**COMPLETED, "params": REFERENCE, "values": {"spare_step": 0.0}},
            "off": {"error": "RuntimeError: Missing key in checkpoint state_dict: optim.state.spare.weight."},
        },
        # (q) the training step after an inference_mode evaluation updates an inference tensor in place
        # (measured 2.13; the old test's reshard case on 2.15); with the patch: the reference without it
        "inference_mode_first_forward": {
            "on": {**COMPLETED, "grads": REFERENCE},
            "off": {"error": "RuntimeError: Inplace update to inference tensor outside InferenceMode is not allowed"},
        },
        # (r) an adapter added after fully_shard: the guard stops the first step; without it each rank
        # trains its own copy, silently (and the synced parameters drift from the in-sync reference)
        "unmanaged_trainable_params_guard": {
            "on": {"error": "GuardError: fsdp-autopatch guard unmanaged_trainable_params_guard: SGD holds 1 "
                            "trainable parameter(s) that FSDP2 does not manage"},
            "off": {**COMPLETED, "params": WRONG, "values": {"adapters_apart": True}},
        },
        # (t) generate() on the PeftModel root never runs the root's pre-forward: its embedding is still a sharded
        # DTensor (measured 2.13 without the colon; 2.14.1 / 2.15.0 sources write "<op>: got mixed"); with the
        # patch the ids generate() returns before and after the step, the grads and the LoRA weights equal the
        # one-process reference (params holds the ids beside the weights)
        "peft_generate_forward_method": {
            "on": {**COMPLETED, "grads": REFERENCE, "params": REFERENCE},
            "off": {"error": ("RuntimeError: aten.embedding.default got mixed torch.Tensor and DTensor",
                              "RuntimeError: aten.embedding.default: got mixed torch.Tensor and DTensor")},
        },
        # (y) the first backward after unfreezing reduces the unit's bf16 gradient as bf16 (reduce_dtype None)
        # and assigns it to the fp32 sharded parameter (measured 2.13: "... to a tensor with grad_dtype 'Float'";
        # the issue's older torch: "... to a tensor with dtype 'float'"); with the fix the weights are bitwise
        # 2.15's (measured), within bf16 tolerance of the fp32 reference (max relative 4.5e-3)
        "frozen_first_mp_dtypes": {
            "on": {**COMPLETED, "params": BF16},
            "off": {"error": "RuntimeError: attempting to assign a gradient with dtype 'c10::BFloat16' to a tensor "
                             "with "},
        },
        # (z) nn.Embedding(max_norm=1.0) in a unit: the renormalized rows are dropped at each reshard, the weights
        # far from the reference that keeps them (measured 2.13: max relative |weight - reference| 3.8 on
        # 0.weight); with the guard the first forward stops at the embedding's post-forward reshard
        "param_written_in_forward": {
            "on": {"error": "GuardError: fsdp-autopatch guard param_written_in_forward: 0.weight (unit 0) was written "
                            "in place since FSDP2 unsharded it"},
            "off": {**COMPLETED, "params": WRONG},
        },
        # (x) each block appends its fp32 auxiliary loss to a copy of the caller's list: 0 of 3 reach the loss
        # (measured 2.13, 2.15: relative |grad - reference| 0.97); with the patch 3 of 3 and the gradients of the
        # one-process bf16 reference (measured 0.0 on 2.13 and 2.15)
        "cast_inputs_keep_containers": {
            "on": {**COMPLETED, "grads": REFERENCE, "values": {"aux_terms": 3}},
            "off": {**COMPLETED, "grads": WRONG, "values": {"aux_terms": 0}},
        },
        # (v) set_reshard_after_backward(False) across 3 clipped SGD steps: model.parameters() shows the unsharded
        # copies without gradients (the clip sees 0 of 6, norm 0.0 against 6.03) and each forward after a step
        # reuses the copy of before it (measured 2.13 and 2.15: relative |weight - reference| 1.9); with the fix
        # the one-process reference (7.7e-08 on 2.13). Outside the measured releases only the stale weights are
        # held: PyTorch's pending-gradient rewrite (commit acf70b43, overlaid on 2.15) registers the sharded
        # parameters after such a backward, so the clip sees 6 of 6 there, and the forward still reuses the stale
        # copy (measured: weights 2.9e-02 off the reference)
        "reshard_stale_unsharded": {
            "on": {**COMPLETED, "params": REFERENCE, "values": {"with_grad": [6, 6, 6]}},
            "off": {**COMPLETED, "params": WRONG,
                    **({"values": {"with_grad": [0, 0, 0]}} if is_measured(release) else {})},
        },
        # (w) an optimizer in backward whose hooks were registered before fully_shard: they never run and the
        # weights never move (measured 2.13, 2.15: 0 of 18 calls); with the fix the reference (bitwise on 2.13, 2.15),
        # and the user's handles still remove the hooks (no call after the removal)
        "param_post_accumulate_hooks": {
            "on": {**COMPLETED, "params": REFERENCE, "values": {"hook_calls": 18, "hook_calls_after_remove": 18}},
            "off": {**COMPLETED, "params": WRONG, "values": {"hook_calls": 0, "hook_calls_after_remove": 0}},
        },
        # (s) gradient clamps by register_hook, before and after fully_shard: they never run, the weights are
        # off the reference (measured 2.13, 2.15: 0 and 0 of 3 calls); the guard stops the first backward at
        # the first group with a hooked parameter (2.weight: backward reaches it first)
        "param_grad_hooks_guard": {
            "on": {"error": "GuardError: fsdp-autopatch guard param_grad_hooks_guard: 1 Tensor.register_hook "
                            "hook(s) on the FSDP2-managed parameter(s) 2.weight would never run"},
            "off": {**COMPLETED, "params": WRONG, "values": {"hook_calls": [0, 0]}},
        },
    }

# What a patch's status claims about its bug's scenario with the patch disabled. On every runnable
# measured release (2.8 - 2.15) ``unpatched_outcome`` equals this mapping of ``expected_status``
# (tests/unit/test_matrix_unmeasured.py checks it): "applied" means the structural check found the
# buggy code, "not_needed" that torch's own fix is there. "unsupported" claims nothing.
_CLAIMS = {"applied": REPRODUCES, "not_needed": FIXED}


def claimed_by(statuses: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """On a release outside :data:`MEASURED`, what the tests check: the plugin's own verdicts.

    ``statuses`` are the registry's statuses on this torch with the defaults (read in the test
    process, where the structural checks decided). Returned: the status every rank must report
    (``NOT_MEASURED`` where ``statuses`` has none, or one in :data:`ALWAYS_WRONG`: then any status
    but those is accepted), and per bug the outcome that status claims for the patch disabled
    (``NOT_MEASURED`` where it claims nothing: the outcome is recorded, not checked).
    """
    status = {
        name: statuses[name] if statuses.get(name) not in (None, *ALWAYS_WRONG) else NOT_MEASURED
        for name in PATCHES
    }
    outcome = {BUG_OF[name]: _CLAIMS.get(status[name], NOT_MEASURED) for name in PATCHES}
    return status, outcome


def status_agrees(expected: str, got: str | None) -> bool:
    """A registry status against its expectation; on an unmeasured release (``NOT_MEASURED``)
    every status agrees except a missing one and those in :data:`ALWAYS_WRONG`."""
    if expected == NOT_MEASURED:
        return got is not None and got not in ALWAYS_WRONG
    return got == expected


def outcome_agrees(expected: str, got: str) -> bool:
    """An observed scenario outcome (``"reproduces: ..."``) against its expectation; anything
    agrees with ``NOT_MEASURED`` (a first measurement records, it does not judge)."""
    return expected == NOT_MEASURED or got.startswith(expected)


# The feature predicates below describe APIs torch added; for a release after the newest measured
# one they answer as for that one: a later torch that removed the API fails the tests that call
# it, which is a finding, never a wrong pass.
def has_native_unused_param_api(release: tuple[int, int]) -> bool:
    return release >= (2, 13)


def has_manual_backward_finalization(release: tuple[int, int]) -> bool:
    """``FSDPModule.set_manual_backward_finalization`` / ``finalize_backward``: torch 2.15 added them
    (2.13 and 2.14 have neither; their pipelining stage finalizes by calling the final callback)."""
    return release >= (2, 15)


# First release whose fake backend writes a reduce-scatter's output; checked against each wheel by
# the fake-backend scenario's probe (test_dist_single_process.py).
_FAKE_REDUCE_SCATTER_WRITES_FROM = (2, 13)


def fake_backend_reduce_scatter_writes_output(release: tuple[int, int]) -> bool:
    """Whether the ``fake`` backend's reduce-scatter (``FakeProcessGroup``, what
    ``init_process_group("fake", ...)`` makes) copies this rank's chunk of the input into the output.
    Before PyTorch PR 182365 it wrote nothing, so FSDP2's gradients under the fake backend are
    whatever its ``new_empty`` reduce-scatter buffer held, with or without the plugin (measured on
    2.8 and 2.12.1); from 2.13 on they are deterministic (measured on 2.13 and 2.15)."""
    return release >= _FAKE_REDUCE_SCATTER_WRITES_FROM
