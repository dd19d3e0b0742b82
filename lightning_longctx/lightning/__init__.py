"""Deprecated: renamed :mod:`lightning_longctx.training` in 0.2 (removed in 0.3)."""

from .._deprecated import alias_package

alias_package(__name__, "lightning_longctx.training")
