#!/usr/bin/env python3
"""What call-time isolation adds to one wrapped call, side by side in one run.

Three variants of the same wrapper around the same stand-in for a torch function, timed in
alternating blocks (``timeit``, best of each block) so that a loaded machine slows all alike:

* ``wrapt``: ``wrapt.FunctionWrapper(original, wrapper)``, the wrapper reading an argument by
  position (how 0.2.0 installed every wrapper);
* ``isolated``: what the plugin installs now (``_patching.replacement_for``): the isolation, a
  ``Call`` per call, the argument read by name;
* ``torch``: the original alone.

Prints nanoseconds per call (median over blocks) and the ratios isolated / wrapt. Usage::

    python3 bench/call_isolation.py [--blocks 15] [--number 20000]
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import wrapt

from fsdp_autopatch import _patching
from fsdp_autopatch._spec import Wrap


def original(fsdp_params, unsharded_grads, *rest):  # foreach_reduce's leading parameters
    return None


def by_position(wrapped, instance, args, kwargs):
    grads = args[1] if len(args) > 1 else kwargs.get("unsharded_grads")
    return wrapped(*args, **kwargs) if grads is not None else None


def by_name(wrapped, instance, args, kwargs):
    grads = wrapped.argument("unsharded_grads")
    return wrapped(*args, **kwargs) if grads is not None else None


def variants() -> dict:
    target = Wrap("m:f", by_name, reads=("fsdp_params", "unsharded_grads"))
    isolated = _patching.replacement_for("bench", target, None, original)
    return {"torch": original, "wrapt": wrapt.FunctionWrapper(original, by_position), "isolated": isolated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--number", type=int, default=20000)
    options = parser.parse_args()
    functions = variants()
    times: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(options.blocks):
        for name, function in functions.items():
            seconds = min(timeit.repeat(lambda f=function: f(1, 2), number=options.number, repeat=3))
            times[name].append(seconds / options.number * 1e9)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, value in medians.items():
        print(f"{name:8} {value:8.0f} ns per call")
    print(f"isolated / wrapt: {medians['isolated'] / medians['wrapt']:.2f}; "
          f"added per call: {medians['isolated'] - medians['wrapt']:.0f} ns")


if __name__ == "__main__":
    main()
