"""The ``rehearsal`` node of ``longctx-rehearse``'s config (``conf/rehearse.yaml``): the ``longctx-train`` tree
(:class:`~lightning_longctx.config_schema.Config`, same groups, same overrides) plus the rehearsal's options.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ..config_schema import OPEN_NODES, Config, open_keys


@dataclass
class RehearsalConf:
    """``out``: write every figure as JSON to this file (null: print only). ``steps``: training steps rehearsed
    (the last is reported: the first allocates the optimizer states, so the second runs with them alive, as
    every later step does; LongStraw primes the optimizer states with a zero-gradient step instead, so ``steps=1``
    suffices there). ``decode_steps``: LongStraw rollouts draw only this many tokens per response and repeat the
    last to ``task.max_new_tokens`` (``sample(decode_steps=...)``: full-length responses and caches); the rollouts'
    FLOPs, traffic, collectives and host syncs are scaled by ``max_new_tokens / decode_steps``, said in the
    output (null: every step). The roofline's figures (:mod:`.roofline`; null: the memory preset's GPU):
    ``bf16_tflops`` (dense peak), ``hbm_gbps``, ``nvlink_gbps``, ``network_gbps`` (per GPU, between nodes),
    ``pcie_gbps`` (GB/s), ``efficiency`` (the fraction of each peak reached)."""

    out: str | None = None
    steps: int = 2
    decode_steps: int | None = None
    bf16_tflops: float | None = None
    hbm_gbps: float | None = None
    nvlink_gbps: float | None = None
    network_gbps: float | None = None
    pcie_gbps: float | None = None
    efficiency: float | None = None


@dataclass
class RehearseConfig(Config):
    rehearsal: RehearsalConf = field(default_factory=RehearsalConf)


def register() -> None:
    """Store ``rehearse_schema`` (idempotent)."""
    ConfigStore.instance().store(name="rehearse_schema", node=open_keys(OmegaConf.structured(RehearseConfig),
                                                                     *OPEN_NODES))


register()

__all__ = ["RehearsalConf", "RehearseConfig", "register"]
