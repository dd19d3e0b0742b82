"""The signature a task module shows the config checks: its own ``__init__``'s parameters plus the keyword
parameters of each base it passes ``**kwargs`` on to, so that ``longctx-train``'s key check of ``task.module``
catches a typo (``task.module.temprature``) instead of letting ``**kwargs`` take it."""

from __future__ import annotations

import inspect
from typing import Any


class KeywordSignature:
    """``__signature__`` of a class, computed for the class it is read on (so a user's subclass with arguments
    of its own, ``MyGRPO(NeedleGRPO)`` with ``bonus``, gets them too): the parameters of its ``__init__``, then,
    while an ``__init__`` takes ``**kwargs``, the keyword-only ones of the next ``__init__`` up the MRO. Read on an
    instance it is absent (``inspect.signature`` of a module instance is its ``__call__``'s, as usual)."""

    def __get__(self, obj: Any, owner: type) -> inspect.Signature:
        if obj is not None:
            raise AttributeError("__signature__")
        params: list[inspect.Parameter] = []
        for klass in owner.__mro__:
            init = vars(klass).get("__init__")
            if init is None:
                continue
            signature = inspect.signature(init)
            for name, p in signature.parameters.items():
                if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or any(q.name == name for q in params):
                    continue
                if params and p.kind != p.KEYWORD_ONLY:  # a base's positional parameters are filled by the subclass
                    continue
                params.append(p)
            if not any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values()):
                break
        return inspect.Signature(params)


__all__ = ["KeywordSignature"]
