"""The bootstrap under the package's name: the very module object ``_fsdp_autopatch_bootstrap``.

The start-up files import the top-level ``_fsdp_autopatch_bootstrap`` (one module; a submodule of
this package would make Python execute the package's ``__init__`` as well, at every interpreter
start). This name stays importable and means the same module, same globals (``source``,
``disabled_at_start``, the trigger), because a ``.pth`` or ``.start`` written by an earlier install
names ``fsdp_autopatch._bootstrap`` (an editable install keeps its copy of them until it is
reinstalled), and so may code that calls ``install()`` after ``python -S``.
"""

import sys

import _fsdp_autopatch_bootstrap

sys.modules[__name__] = _fsdp_autopatch_bootstrap
