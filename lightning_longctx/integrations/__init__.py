"""Integrations with other libraries. :mod:`.hf`: Ulysses for any transformers causal LM
(:func:`~.hf.install_ulysses`); importing it does not import transformers until it is used."""

from .hf import UlyssesHandle, install_ulysses, uninstall_ulysses

__all__ = ["UlyssesHandle", "install_ulysses", "uninstall_ulysses"]
