"""What a compiled module does when its model changed between calls (:class:`Recompiles`): it
compiles again, until one value has changed too often."""

from __future__ import annotations

import collections
import logging

__all__ = ["RECOMPILE_LIMIT", "Recompiles"]

log = logging.getLogger("fusion_compiler")

RECOMPILE_LIMIT = 8
"""Compiles that one value (an attribute, a global, a class attribute) may cause by changing before
the compiled module stops compiling and runs the model uncompiled (Dynamo stops at 8 compiles of
one frame too: ``torch._dynamo.config.recompile_limit``)."""


class Recompiles:
    """What the compiled module ``name`` does when :class:`StateGuard` finds the model changed:
    it compiles again, logging why (a value's first change as a WARNING, later ones at INFO; at
    DEBUG when nothing was compiled yet); once one value has changed at more than
    :data:`RECOMPILE_LIMIT` compiles (a step counter a forward reads), :attr:`uncompiled` says
    why, and the compiled module runs the model uncompiled from then on: correct at eager's
    speed, instead of a compile at every call."""

    def __init__(self, name: str):
        self.name = name
        self.counts: collections.Counter[str] = collections.Counter()
        self.uncompiled = ""

    def note(self, what: str, compiled: int) -> None:
        """``what`` (:meth:`StateGuard.describe`) changed; ``compiled`` specializations are
        dropped."""
        key = what.split(" was")[0]
        value = key.startswith(("attribute", "global", "class", "closure"))
        self.counts[key] += bool(compiled)
        first = compiled and value and self.counts[key] == 1
        log.log(logging.WARNING if first else logging.INFO if compiled else logging.DEBUG,
                "%s: %s since it was compiled: its %d specialization(s) are compiled again%s",
                self.name, what, compiled, "; pass a value that changes between calls as an "
                "argument of forward" if first else "")
        if value and self.counts[key] > RECOMPILE_LIMIT and not self.uncompiled:
            self.uncompiled = f"{key} changed at {self.counts[key]} compiles"
            log.warning("%s: %s: from now on its calls run the model uncompiled (pass the value "
                        "as an argument of forward, or keep it constant)", self.name,
                        self.uncompiled)
