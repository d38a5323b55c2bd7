"""``fsdp-autopatch gpu-check``: check the plugin as installed in this environment where users
train, NCCL on CUDA (or gloo on CPU: the same logic, small). Bounded in time; a JSON report and a
printed table. The options are the CLI's (``fsdp_autopatch._cli``); the driver is ``_main``.

This interpreter is probed in a fresh process (its ``.pth`` must activate this very plugin), then
ranks of it are launched with the package's launcher (``fsdp_autopatch._launch``) as
``python -m fsdp_autopatch._gpu_check._rank`` (on the rank side shared with the demo,
``fsdp_autopatch._rank_side``), each launch with a process-group timeout inside the ranks and an outer
timeout, all under one overall time guard:

1. every patch's bug case that can strike at this world size (its case module,
   ``fsdp_autopatch.cases.<entry>``), with the plugin on, and with that patch disabled by its
   variable (``_entries``);
2. a training run meeting the first four bugs at once (bf16 params, fp32 reduce), eager, with
   per-block ``torch.compile`` and, on CUDA, with ``CPUOffloadPolicy(pin_memory=True)``, plugin on
   and off (``FSDP_AUTOPATCH_ENABLED=0``; ``_training``: the demo's training, ``cases._four_bugs``);
3. Dynamo's counters per compile mode (whole model ``torch.compile``, blocks ``.compile()``d after
   ``fully_shard``, torchtitan's order), plugin on and off (``FSDP_AUTOPATCH_ENABLED=0``): graph
   breaks, recompiles, graphs and frames compiled, and whether the final weights are bitwise equal
   (``_compile``); skipped, saying why, where the time guard is short or torch.compile cannot run;
4. the step cost, plugin off against on, with the unused-param fill off and on, alternating blocks
   in one process (CUDA events on a GPU), with the restore's host sync and peak memory (``_cost``, whose
   model, step and alternation ``bench/step_overhead.py`` also uses).

With ``--expected PATH`` (a checkout's ``tests/expected.py``) the plugin-off results are compared
with what it says for this torch (differences are findings); without it they are recorded only.
``scripts/gpu_check.py`` of a checkout runs this command from the checkout's wheel in a throwaway venv.

Nothing is imported here: ``import fsdp_autopatch`` and the start-up path never load this package,
and the rank processes import only what they run.
"""
