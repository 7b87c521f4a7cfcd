"""A class forward rebuilt with some of its module-level names resolved to our adapters
(`with_globals`), bound to one module instance (`ReboundForward`); transformers' module and
class stay untouched."""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping

from ascend_vlm._compat.decorators import rewrap


def with_globals(function: types.FunctionType, replacements: Mapping[str, object]):
    """`function`'s own code with the globals named in `replacements` resolved to their values.

    One globals snapshot per call; the original module is not modified. A decorated function is
    rebuilt around the rebound function it decorates (`rewrap`). The snapshot drops
    ``__name__``: Dynamo resolves the globals of a function it inlines through the module of
    that name when there is one, and would then guard on the module's own functions instead of
    our adapters; without it, Dynamo reads and guards on this dict, so torch.compile and
    torch.export see the adapters.
    """
    if hasattr(function, "__wrapped__"):
        return rewrap(function, with_globals(function.__wrapped__, replacements))
    rebound_globals = {**function.__globals__, **replacements}
    del rebound_globals["__name__"]
    clone = types.FunctionType(
        function.__code__,
        rebound_globals,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    clone.__kwdefaults__ = function.__kwdefaults__
    clone.__qualname__ = function.__qualname__
    return clone


class ReboundForward(functools.partial):
    """A module's ``forward`` rebuilt by `with_globals`, bound to the module (called like the
    bound method). Pickles as its recipe ``(factory, *arguments)``: ``factory(module,
    *arguments)`` builds it again, since the rebuilt function has no importable name."""

    recipe: tuple

    def __reduce__(self):
        factory, *arguments = self.recipe
        return factory, (self.args[0], *arguments)
