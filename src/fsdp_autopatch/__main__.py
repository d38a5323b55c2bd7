"""``python -m fsdp_autopatch`` and the ``fsdp-autopatch`` console script -> the CLI.

Only the standard library here: if one of the package's own modules fails to import on this
interpreter, ``status`` and ``doctor`` still say which one and why, instead of a bare traceback.
"""

import sys


def main(argv=None):
    try:
        from ._cli import main as cli_main
    except Exception as error:
        return _report_broken_package(error)
    try:
        return cli_main(argv)
    except BrokenPipeError:
        # `fsdp-autopatch doctor | head -1`: the reader left before the verdict was written. Exit
        # as a shell tool killed by SIGPIPE does (128 + 13), not 1 ("not protected"), and without a
        # traceback; stdout goes to devnull so the interpreter's final flush is quiet.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _report_broken_package(error):
    import traceback

    try:
        from ._process import our_module_in

        where = our_module_in(error)
    except Exception:  # this module itself is what broke
        where = "fsdp_autopatch._process"
    python = sys.version.split()[0]
    sys.stderr.write(
        f"fsdp-autopatch: its module {where} cannot be imported on Python {python} "
        f"({type(error).__name__}: {error}).\n"
        "The patches are not applied in this interpreter; torch is left untouched and training runs unpatched.\n"
        "Please report it with the traceback below; meanwhile pin a fsdp-autopatch release that works here, "
        "or set FSDP_AUTOPATCH_ENABLED=0.\n\n"
    )
    traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
