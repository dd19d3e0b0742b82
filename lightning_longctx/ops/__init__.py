"""Single-device building blocks for long contexts: exact, memory-bounded ops with their own backward.

Main API:

- :func:`attention_with_lse`: memory-efficient attention ``[batch, seq, heads, head_dim]`` that also
  returns its log-sum-exp; :func:`attention_forward` / :func:`attention_backward` are the raw passes
  segmented attention is built from. The plain ``attention`` function is not re-exported here: the name
  would shadow the ``ops.attention`` submodule (import it as ``from lightning_longctx.ops.attention import
  attention``).
- :func:`merge_attention_outputs` merges partial attentions by LSE; :func:`prefix_attention` attends new
  tokens to a cached prefix plus themselves (causally).
- :func:`chunked_token_logprobs` / :func:`chunked_cross_entropy`: lm_head log-probs and summed loss
  without materialising ``[tokens, vocab]`` logits.
- :func:`gated_delta_rule` (:class:`GatedDeltaOutput`): the Gated DeltaNet scan ``[batch, seq, heads, dim]``
  with initial/final/boundary states; chunked torch path with an O(chunk) recompute backward, or
  flash-linear-attention's kernel on CUDA.
- :func:`tiled_mlp`: a token-wise MLP run and recomputed over slices of the sequence.
- :func:`track_memory` (:class:`MemoryTracker` on CPU, :class:`CudaMemoryTracker` on CUDA): live and peak
  tensor bytes of a block of code, to pin memory bounds in tests; :func:`reset_device_peak` /
  :func:`device_peak_bytes`: the device's own absolute peak over a training step, at no per-op cost.
"""

from .attention import attention_backward, attention_forward, attention_with_lse
from .gated_delta import GatedDeltaOutput, gated_delta_rule
from .losses import chunked_cross_entropy, chunked_token_logprobs
from .merge import merge_attention_outputs, prefix_attention
from .mlp import tiled_mlp
from .tracker import CudaMemoryTracker, MemoryTracker, device_peak_bytes, reset_device_peak, track_memory

__all__ = [
    "CudaMemoryTracker",
    "GatedDeltaOutput",
    "MemoryTracker",
    "attention_backward",
    "attention_forward",
    "attention_with_lse",
    "chunked_cross_entropy",
    "chunked_token_logprobs",
    "device_peak_bytes",
    "gated_delta_rule",
    "merge_attention_outputs",
    "prefix_attention",
    "reset_device_peak",
    "tiled_mlp",
    "track_memory",
]
