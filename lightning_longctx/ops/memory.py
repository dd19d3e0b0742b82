"""Deprecated: renamed :mod:`lightning_longctx.ops.tracker` in 0.2 (removed in 0.3)."""

from .._deprecated import alias_module

alias_module(__name__, "lightning_longctx.ops.tracker")
