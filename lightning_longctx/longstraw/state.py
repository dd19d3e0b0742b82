"""The prompt's state between the passes of one LongStraw step: per layer its cache, checkpoint and the
gradient summed into the cache over the group (see :mod:`.prefix` for the passes)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..models.dsa import DSAState
from ..models.fused_attention import PrefixCache
from ..models.gated_deltanet import LinearState
from ..models.mla import MLAState, StagedLatent
from ..ops.host_pages import PagedHostTensor
from ..parallel import group_rank, group_size, shard_sequence
from .grads import CacheGradSink, StagedGradSink, move_grad_into
from .latent import latent_grad, latent_leaf
from .offload import HostStager, to_host

_LATENT_STATES = (MLAState, DSAState)  # a latent leaf (:mod:`.latent`; DSA: with the index keys, graph-free)
# offloaded (``stager``): attention K/V and latent states (the latent and DSA's index keys) live on the host;
# Gated DeltaNet states (small: one recurrent state per layer) stay on the device as leaves


@dataclass
class PromptState:
    """What later tokens need of the prompt, per layer; nothing else of the prompt stays alive.

    ``caches``: per layer, its state after the cached prompt, as the layer's ``return_state`` gives it
    (head-sharded under SP): attention ``(keys, values)``, each ``[1, S', kv_cache_heads, head_dim]`` in the
    compute dtype, graph-free; Gated DeltaNet a :class:`~lightning_longctx.models.LinearState` (recurrent state
    ``[1, Hv/P, Dk, Dv]`` in fp32, conv tail ``[1, K-1, C_l]``, and for the grouped backward the states every
    ``state_segment`` tokens, graph-free, possibly on the host); MLA an :class:`~lightning_longctx.models.mla.
    MLAState` (the latent ``[1, S'/P, R + r]``, a leaf, sequence-sharded); DSA a :class:`~lightning_longctx.
    models.dsa.DSAState` (the same latent leaf and, on a full layer, the graph-free index keys ``[1, S'/P, D_I]``:
    no gradient reaches the indexer, :mod:`.latent`). When the prompt gradient is wanted, every
    branch's backward accumulates into one gradient buffer per layer and tensor in ``grad_dtype`` (fp32 by
    default, so the sum over the G branches never rounds at bf16 precision; :meth:`cache_grad` reads it):
    attention K/V through :meth:`replay_cache`'s sink, which the fused attention's backward adds each stage's
    slice into in place (:class:`.grads.CacheGradSink`); Gated DeltaNet states are leaves whose bf16 gradient a
    post-accumulate hook moves into the buffer.
    ``checkpoints``: per layer, its input ``[1, S'/P, hidden]`` on this rank (possibly on the host), for the
    grouped backward; with ``checkpoint_every = k > 1`` only layers ``0, k, 2k, ...`` (None elsewhere until the
    grouped backward rebuilds their segment). ``attention_outputs`` (``keep_attention_output``): per attention
    layer but the last, each stage's head-sharded attention output ``[1, S', C, d]`` and LSE ``[1, C, S']``
    (fp32) from the prefill, on the device or the host, so the grouped backward runs the attention backward
    without attending again (:func:`attention_output_bytes`); None elsewhere.
    """

    prompt_ids: torch.Tensor  # [S], full
    cached_length: int  # S'
    group: dist.ProcessGroup | None
    caches: list = field(default_factory=list)
    checkpoints: list[torch.Tensor] = field(default_factory=list)
    grad_dtype: torch.dtype = torch.float32
    grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, tensor index) -> buffer
    state_segment: int | None = None
    stager: HostStager | None = None  # offload_prompt_cache: K/V, latents (+ index keys), their sums on the host
    cache_requires_grad: bool = False
    param_versions: tuple[int, ...] = ()  # the parameters' version counters at prefill (see check_prompt_state)
    consumed: bool = False  # a grouped backward ran over it (its caches and checkpoints are gone)
    attention_outputs: list = field(default_factory=list)  # per layer: [(out, lse) per stage] or None
    checkpoint_every: int = 1  # the prefill kept the input of every that many layers (segments; the rest None)
    offload_checkpoints: bool = False  # the checkpoints (and the grouped backward's rebuilt inputs) on the host

    def add_cache(self, cache, requires_grad: bool, *, offload: bool = False) -> None:
        """Append one layer's state; with ``requires_grad`` its gradients sum in ``grad_dtype``.

        ``cache``: ``(keys, values)`` (kept graph-free: the replay's sink collects their gradient, see
        :meth:`replay_cache`; on the host with ``stager``) or a ``LinearState`` (kept as leaves; its
        ``boundaries`` stay graph-free, on the host with ``offload``)."""
        layer = len(self.caches)
        self.cache_requires_grad = requires_grad
        if isinstance(cache, _LATENT_STATES) and self.stager is not None:  # the latent (+ index keys) on the host:
            # plain tensors, their gradient summed through :meth:`replay_cache`'s sink (:class:`StagedLatent`)
            self.caches.append(type(cache)(*(None if t is None else self.stager.to_host(t.detach()) for t in cache)))
            return
        if isinstance(cache, _LATENT_STATES):  # the latent, sequence-sharded, on the device (:mod:`.latent`)
            self.caches.append(latent_leaf(self, layer, cache, requires_grad))
            return
        if not isinstance(cache, LinearState):
            move = self.stager.to_host if self.stager is not None else lambda t: t
            self.caches.append(tuple(move(t.detach()) for t in cache))
            return
        leaves = []
        for which, t in enumerate(cache[:2]):
            leaf = t.detach().requires_grad_(requires_grad)
            if requires_grad and leaf.dtype != self.grad_dtype:
                leaf.register_post_accumulate_grad_hook(move_grad_into(self.grads, (layer, which), self.grad_dtype))
            leaves.append(leaf)
        boundaries = cache.boundaries
        if boundaries is not None and offload:
            boundaries = to_host(boundaries)
        self.caches.append(LinearState(*leaves, boundaries))

    def cache_grad(self, layer: int, which: int) -> torch.Tensor | None:
        """The gradient summed over the group so far of layer ``layer``'s state tensor ``which`` (attention:
        0 = keys, 1 = values; Gated DeltaNet: 0 = recurrent state, 1 = conv tail); offloaded: a CPU tensor read
        from its host pages (their copies landed: this waits for them). MLA / DSA: 0 = the latent."""
        if isinstance(self.caches[layer], _LATENT_STATES) and not self.staged(layer):
            return latent_grad(self, layer, which)
        if (layer, which) in self.grads:
            if self.stager is not None:
                self.stager.synchronize()
            grad = self.grads[(layer, which)]
            return grad.to("cpu") if isinstance(grad, PagedHostTensor) else grad
        cache = self.caches[layer]
        return cache[which].grad if isinstance(cache, LinearState) else None

    def layer_cache(self, layer: int):
        """Layer ``layer``'s state, graph-free (None when nothing was cached): attention ``(keys, values)`` on
        the device (offloaded: a device copy, the next offloaded layer's already starting on the side stream),
        for decoding and scoring; a ``LinearState`` as kept. A branch replay that trains uses
        :meth:`replay_cache`."""
        if not self.caches:
            return None
        cache = self.caches[layer]
        if not self.staged(layer):
            return cache
        return self._fetch(layer, +1)

    def staged(self, layer: int) -> bool:
        """Whether layer ``layer``'s state lives on the host (offloaded K/V or latent), fetched per use."""
        return self.stager is not None and self.caches[layer] is not None and \
            not isinstance(self.caches[layer], LinearState)

    def replay_cache(self, layer: int):
        """Layer ``layer``'s state as a branch replay's ``prefix_state``: a ``LinearState`` as kept; attention
        K/V as a :class:`~lightning_longctx.models.fused_attention.PrefixCache` whose gradient sink adds each
        stage's slice into this state's ``grad_dtype`` buffers (when ``cache_requires_grad``). Offloaded K/V
        are fetched by the forward and again by the backward (the previous offloaded layer in flight then)."""
        if not self.caches:
            return None
        cache = self.caches[layer]
        if isinstance(cache, _LATENT_STATES) and self.staged(layer):
            return self._staged_latent(layer)
        if isinstance(cache, (LinearState, *_LATENT_STATES)):
            return cache
        sink = None
        if self.cache_requires_grad and self.stager is None:
            sink = CacheGradSink(self.grads, layer, cache[0], self.grad_dtype)
        elif self.cache_requires_grad:
            sink = StagedGradSink(lambda: self._device_grad_sums(layer),
                                  lambda sums: self._store_grad_sums(layer, sums))
        if self.stager is None:
            return PrefixCache(cache, grad_sink=sink)
        return PrefixCache(fetch=lambda backward: self._fetch(layer, -1 if backward else +1), grad_sink=sink)

    def _fetch(self, layer: int, step: int):
        """A device copy of offloaded layer ``layer``'s state (K/V; a latent state with its index keys, as
        decoding reads it); the next staged layer in direction ``step`` starts copying. Backward (``step=-1``):
        first the layer's own gradient sums so far start copying, for its sink (they overlap the first stage's
        recomputation; one layer's sums on the device, plus the layer above's until their copy back has run)."""
        if step < 0:
            self._prefetch_grad_sums(layer)
        cache = self.caches[layer]
        nxt = self._staged_neighbour(layer, step, lambda c: type(c) is type(cache))
        if nxt is not None:
            self.stager.prefetch(("cache", nxt), _present(self.caches[nxt]))
        fetched = iter(self.stager.fetch(("cache", layer), _present(cache)))
        if not isinstance(cache, _LATENT_STATES):
            return tuple(fetched)
        return type(cache)(*(None if t is None else next(fetched) for t in cache))

    def _staged_latent(self, layer: int) -> StagedLatent:
        """Offloaded latent layer ``layer`` as a replay's ``prefix_state``: the latent fetched by the forward and
        again by the backward's recomputation (the next / previous offloaded latent in flight), DSA's index keys
        by the forward's selection, and (``cache_requires_grad``) a sink adding each branch's latent gradient
        into the layer's sums (brought to the device with the backward's fetch, written back at once)."""
        cache = self.caches[layer]
        sink = None
        if self.cache_requires_grad:
            def sink(grad: torch.Tensor) -> None:
                sums = self._device_grad_sums(layer)
                sums[0].add_(grad)  # in grad_dtype: the same sum as the leaf's .grad on the device
                self._store_grad_sums(layer, sums)

        def fetch_keys() -> torch.Tensor:
            nxt = self._staged_neighbour(layer, +1, lambda c: getattr(c, "index_keys", None) is not None)
            if nxt is not None:
                self.stager.prefetch(("index_keys", nxt), [self.caches[nxt].index_keys])
            return self.stager.fetch(("index_keys", layer), [cache.index_keys])[0]

        keys = getattr(cache, "index_keys", None) is not None
        return StagedLatent(cache.latent.shape[1], lambda backward: self._fetch_latent(layer, backward),
                            grad_sink=sink, fetch_index_keys=fetch_keys if keys else None)

    def _fetch_latent(self, layer: int, backward: bool) -> torch.Tensor:
        """A device copy of offloaded layer ``layer``'s latent; the next (forward) or previous (``backward``)
        offloaded latent starts copying, and in a backward first this layer's gradient sums."""
        step = -1 if backward else +1
        if backward:
            self._prefetch_grad_sums(layer)
        nxt = self._staged_neighbour(layer, step, lambda c: isinstance(c, _LATENT_STATES))
        if nxt is not None:
            self.stager.prefetch(("latent", nxt), [self.caches[nxt].latent])
        return self.stager.fetch(("latent", layer), [self.caches[layer].latent])[0]

    def _grad_count(self, layer: int) -> int:
        """How many of layer ``layer``'s state tensors receive a gradient: K and V, or the latent alone."""
        return 1 if isinstance(self.caches[layer], _LATENT_STATES) else 2

    def _prefetch_grad_sums(self, layer: int) -> None:
        if self.cache_requires_grad and (layer, 0) in self.grads:
            self.stager.prefetch(("grad", layer), [self.grads[(layer, w)] for w in range(self._grad_count(layer))])

    def _device_grad_sums(self, layer: int) -> list[torch.Tensor]:
        """Offloaded layer ``layer``'s gradient sums so far on the device (K/V, or the latent; zeros before its
        first branch)."""
        count = self._grad_count(layer)
        if (layer, 0) not in self.grads:
            like = self.caches[layer][0]  # keys (values have their shape) or the latent
            return [torch.zeros(like.shape, dtype=self.grad_dtype, device=self.stager.device) for _ in range(count)]
        return self.stager.fetch(("grad", layer), [self.grads[(layer, w)] for w in range(count)])

    def _store_grad_sums(self, layer: int, sums: list[torch.Tensor]) -> None:
        """Write a branch's updated sums of offloaded layer ``layer`` back to its host buffers (pinned, in
        flight); a prefetch of the old sums still pending is dropped."""
        self.stager.discard(("grad", layer))
        for which, t in enumerate(sums):
            host = self.grads.get((layer, which))
            if host is None:
                self.grads[(layer, which)] = self.stager.to_host(t)
            else:
                self.stager.store(host, t)

    def device_cache_grads(self, layer: int, device) -> list[torch.Tensor | None]:
        """Layer ``layer``'s summed state gradients on ``device`` (for the grouped backward); offloaded ones come
        from the host, and the previous offloaded layer's start copying."""
        if not self.staged(layer):
            return [self.cache_grad(layer, which) for which in (0, 1)]
        grads = [self.grads.get((layer, which)) for which in (0, 1)]  # host buffers, in flight: fetched in order
        prev = self._staged_neighbour(layer, -1, lambda c: True)
        pending = [] if prev is None else [g for g in (self.grads.get((prev, w)) for w in (0, 1)) if g is not None]
        if pending:
            self.stager.prefetch(("grad", prev), pending)
        present = [g for g in grads if g is not None]
        fetched = iter(self.stager.fetch(("grad", layer), present) if present else [])
        return [None if g is None else next(fetched).to(device) for g in grads]

    def _staged_neighbour(self, layer: int, step: int, kind) -> int | None:
        """The next (``step=1``) or previous (``-1``) layer whose state is staged from the host and satisfies
        ``kind(cache)``, or None."""
        index = layer + step
        while 0 <= index < len(self.caches):
            if self.staged(index) and kind(self.caches[index]):
                return index
            index += step
        return None

    @property
    def tail_ids(self) -> torch.Tensor:
        """Prompt tokens not in the cache (at least the last one), replayed at the head of every branch."""
        return self.prompt_ids[self.cached_length:]

    def local_prefix(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's cached-prompt ids and global positions, ``[1, S'/P]`` each."""
        world, rank = group_size(self.group), group_rank(self.group)
        ids = self.prompt_ids[: self.cached_length].view(1, -1)
        pos = torch.arange(self.cached_length, device=ids.device).view(1, -1)
        return shard_sequence(ids, rank, world), shard_sequence(pos, rank, world)



def _present(cache) -> list[torch.Tensor]:
    """A staged state's tensors (a shared DSA layer has no index keys)."""
    return [t for t in cache if t is not None]


__all__ = ["PromptState"]
