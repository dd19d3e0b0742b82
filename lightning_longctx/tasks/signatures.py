"""The signature a task module shows the config checks: its own parameters plus the keyword parameters of the
base it passes ``**kwargs`` on to, so that ``longctx-train``'s key check of ``task.module`` catches a typo
(``task.module.temprature``) instead of letting ``**kwargs`` take it."""

from __future__ import annotations

import inspect


def merged_signature(cls: type, base: type) -> inspect.Signature:
    """``cls.__init__``'s parameters (without ``self`` and ``**kwargs``) followed by ``base.__init__``'s keyword-only
    ones that ``cls`` does not declare itself."""
    own = inspect.signature(cls.__init__).parameters
    inherited = inspect.signature(base.__init__).parameters
    params = [p for name, p in own.items() if name != "self" and p.kind != p.VAR_KEYWORD]
    params += [p for name, p in inherited.items() if p.kind == p.KEYWORD_ONLY and name not in own]
    return inspect.Signature(params)


__all__ = ["merged_signature"]
