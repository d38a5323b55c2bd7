"""``fsdp-autopatch demo``: train a tiny vision-language MoE on two CPU ranks and show the four bugs.

Run ``fsdp-autopatch demo`` (or ``python -m fsdp_autopatch demo``) to see the patches at work, and
``fsdp-autopatch demo --without-patches`` to see what PyTorch's FSDP2 does without them.

The model
---------
Two ranks on gloo train a deliberately small model with ``fully_shard`` and
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``, AdamW with weight
decay, ``STEPS`` optimizer steps of ``MICRO_BATCHES`` micro-batches each, gradient sync off
(``set_requires_gradient_sync(False)``) on every micro-batch but the last, and the unused-parameter
fill on (``set_reduce_scatter_unused_params(True)``, torch's own API from 2.13, the package's
backport before).

    tokens ─► embed ─┐
                     + ─► mixer ─► MoE (3 experts, routed by token id) ─► head ─► logits
    pixels ─► vision ┘    (vision: its own FSDP unit;  MoE: its own FSDP unit;  rest: the root unit)

Every part is chosen to hit one bug:

(a) accumulated_grad_guard -- the vision tower is a separately wrapped unit and only the last
    micro-batch of a step carries images. On step 1 the tower has never run forward when the first,
    text-only micro-batch finishes backward; FSDP's root callback still runs the tower's
    post-backward, which reads the not-yet-created ``_unsharded_param``: AttributeError.
(b) unused_param_reduction -- the MoE routes token ids 0-7 to expert 0, 8-15 to expert 1 and
    16-23 to expert 2. Rank 0's text uses ids 0-15, rank 1's ids 0-7, and no rank ever sees 16-23.
    So expert 1 has a gradient on rank 0 only: without the fill the two ranks reduce-scatter
    different amounts of data (gloo raises; NCCL can hang or mix gradients).
(c) uniform_reduce_dtype -- with the fill, the zero gradient given to expert 1 (rank 1) and expert 2
    (both ranks) is bf16 while expert 0's gradient, accumulated over the earlier micro-batches, is
    fp32: FSDP's reduce-scatter asserts "uniform gradient dtype".
(d) restore_unused_param_grads -- expert 2 is used by no rank, yet the fill turns its missing
    gradient into an exact zero, so AdamW applies weight decay and moves its weights.

With the patches, the demo checks and prints three invariants:
(1) the gradients of every used parameter (shared layers, vision tower, experts 0 and 1) match a
    single-process reference on the same global batch and micro-batching with the same bf16 compute
    (computed in rank 0 from the gathered weights of each step), within bf16 tolerance;
(2) the never-used expert keeps ``grad is None`` after every backward and its weights stay bitwise
    unchanged;
(3) the loss decreases (every step trains on the same fixed global batch).

Modes and exit codes
--------------------
``demo``: exit 0 if the run completes and all three invariants hold, else 1.

``demo --without-patches``: a failure masks the next one, so the demo runs one short two-rank
sub-run per bug: (a) with no patches at all (``FSDP_AUTOPATCH_ENABLED=0``); (b), (c), (d) each with
only that bug's patch disabled (``FSDP_AUTOPATCH_<NAME>_ENABLED=0``; for (b) the demo also does not
call ``set_reduce_scatter_unused_params``, the only way to switch the fill off when torch provides it
itself). It prints, per bug, what happened, the upstream report and the patch that fixes it. Exit 0
if every bug reproduced as expected (it is a demonstration), 1 otherwise, e.g. when a bug does not
reproduce because this torch fixed it upstream.

Every sub-run is bounded: a short gloo timeout, an outer timeout that kills both ranks' process
groups, a grace period after the first rank fails (a rank that fails alone leaves its peer waiting
in a collective), and a watchdog in each rank that exits when the demo's parent process goes away.
Inherited ``FSDP_AUTOPATCH_*`` settings other than ``FSDP_AUTOPATCH_LOG_LEVEL`` are removed from the
ranks' environment so that each mode runs exactly the configuration it describes; the demo names
them on stderr before it starts.

Implementation: stdlib only at import time; torch is imported inside the rank process
(``python -m fsdp_autopatch.demo --worker ...``) and inside functions only.

Modules: the model, data, loss, training loop and invariants are ``fsdp_autopatch.cases._four_bugs``
(shared with ``gpu-check``); ``_scenarios`` (what each sub-run disables, its timeouts), ``_worker``
(the rank side: a sub-run's rank, its report), ``_subrun``
(the parent side of a sub-run, on the launcher shared with the tests, ``fsdp_autopatch._launch``),
``_judges`` (did each bug reproduce) and ``_report`` (what is printed); what a rank does as the GPU
check's ranks do (watchdog, process group, error record, JSON result) is ``fsdp_autopatch._rank_side``.
"""

from __future__ import annotations

import argparse
import os
import sys

from .._config import PREFIX
from ._bugs import BUG_SHOWS, demo_bug
from ._report import demo_patched, demo_without_patches
from ._scenarios import RUN_TIMEOUT_S, SCENARIOS
from ._subrun import KEEP_ENV

__all__ = ["main", "demo_bug", "demo_patched", "demo_without_patches"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-autopatch demo",
        description="Train a tiny vision-language MoE with FSDP2 on two CPU ranks and check that "
                    "the bugs of the first four patches stay fixed; --bug NAME shows another patch's bug "
                    "on its own model.")
    parser.add_argument("--without-patches", action="store_true",
                        help="reproduce each bug with its patch disabled "
                             "(exit 0 if all four of the MoE's bugs reproduce)")
    parser.add_argument("--bug", choices=sorted(BUG_SHOWS), metavar="NAME",
                        help="one bug's own small run, without its patch then with it: "
                             + ", ".join(BUG_SHOWS))
    parser.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S,
                        help=f"seconds before a sub-run's ranks are killed (default {RUN_TIMEOUT_S:g})")
    # Internal: the rank processes the demo launches.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scenario", default="patched", choices=sorted(SCENARIOS),
                        help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=RUN_TIMEOUT_S + 10, help=argparse.SUPPRESS)
    return parser


def ignored_settings_note(environ=os.environ) -> str:
    """A line naming the caller's ``FSDP_AUTOPATCH_*`` settings the ranks will not see ('' if none):
    each mode runs the configuration it describes, and a silently dropped setting would surprise."""
    ignored = sorted(v for v in environ if v.startswith(PREFIX) and v not in KEEP_ENV)
    if not ignored:
        return ""
    return (f"note: the demo sets the plugin's variables for each run itself; ignoring {', '.join(ignored)} "
            f"from your environment ({', '.join(KEEP_ENV)} is kept)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        # Only a rank process imports the rank side (it is never imported by the parent).
        if args.bug:
            from ._bug_ranks import bug_worker_main

            return bug_worker_main(args.bug, args.rank, args.out, args.deadline)
        from ._worker import worker_main

        return worker_main(args.scenario, args.rank, args.out, args.deadline)
    note = ignored_settings_note()
    if note:
        print(note, file=sys.stderr)
    try:
        if args.bug:
            return demo_bug(args.bug, args.timeout)
        if args.without_patches:
            return demo_without_patches(args.timeout)
        return demo_patched(args.timeout)
    except KeyboardInterrupt:  # the running sub-run's ranks were already killed on the way out
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout.flush()
