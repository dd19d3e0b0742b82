"""Deprecated: renamed :mod:`lightning_longctx.planner` in 0.2 (``memory.planner`` is ``planner.budget``)."""

from .._deprecated import alias_package

alias_package(__name__, "lightning_longctx.planner", renamed={"planner": "budget"})
