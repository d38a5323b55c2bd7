"""post_backward_census: a harmless third-party patch, the worked example of fsdp-autopatch's entry points.

What it does
    Counts, per FSDP2 unit (``FSDPParamGroup``), how many times its post-backward ran in this
    process: ``census()`` returns ``{unit's module path: count}``. It changes nothing torch does
    (it never calls ``fsdp_autopatch.fired``: there is nothing it fixes), which makes it safe to
    ship as an example. A unit that is missing from the census never ran backward on this rank,
    e.g. a vision tower on text-only micro-batches.

How it is shipped
    ``pyproject.toml`` declares the entry point ``post_backward_census = "fsdp_autopatch_example:PATCH"``
    in the group ``fsdp_autopatch.patches``. fsdp-autopatch finds it when torch's FSDP2 is imported,
    applies it after its own patches, and gives it a toggle
    (``FSDP_AUTOPATCH_POST_BACKWARD_CENSUS_ENABLED=0``), a registry record (``provider``:
    ``fsdp-autopatch-example 0.1.0``), ``doctor`` and the cross-rank check.

Torch versions
    Every FSDP2 release (``FSDPParamGroup.post_backward`` exists from 2.6).
"""

from collections import Counter

from fsdp_autopatch import Patch, Wrap, needed, unsupported

_counts = Counter()
_TARGET = "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.post_backward"


def census():
    """``{unit: number of post-backward calls}`` in this process."""
    return dict(_counts)


def _structural_check():
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    if not callable(getattr(FSDPParamGroup, "post_backward", None)):
        return unsupported("FSDPParamGroup.post_backward not found")
    return needed("FSDPParamGroup.post_backward is there to count")


def _count(wrapped, group, args, kwargs):
    fqn = getattr(group, "_module_fqn", None)  # "" for the root module's unit
    _counts["<root>" if fqn == "" else str(fqn or "?")] += 1
    return wrapped(*args, **kwargs)


PATCH = Patch(
    name="post_backward_census",
    summary="count each FSDP2 unit's post-backward calls (a harmless example)",
    symptom="nothing goes wrong without it; it shows which units ran backward",
    trigger="every backward",
    upstream=(),
    affected=">=2.6",
    check=_structural_check,
    targets=(Wrap(_TARGET, _count),),
    changes="every unit's post-backward is counted (fsdp_autopatch_example.census())",
)
