"""Rotary position embeddings at global positions: default RoPE and transformers' scaled variants.

Layout: ``x [batch, seq, heads, head_dim]`` (BSHD) and ``cos, sin [batch, seq, rotary_dim]``. Under sequence
parallelism each rank passes the *global* ``position_ids`` of its slice, so RoPE is applied before the
all-to-all with the true positions.

Scaled RoPE (``linear``, ``dynamic``, ``yarn``, ``longrope``, ``llama3``) takes its inverse frequencies and
its attention scaling from transformers' own ``ROPE_INIT_FUNCTIONS`` (imported only for those types), called
on a minimal transformers config built from the :class:`~lightning_longctx.models.DecoderConfig`. ``dynamic``
and ``longrope`` depend on the sequence length: as a freshly loaded transformers model in one forward, with
the length taken over the whole sequence-parallel group. This module also translates the RoPE fields of an HF
``config.json`` both ways (:func:`rope_fields_from_hf`, :func:`rope_fields_to_hf`).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from ..parallel import group_size

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")  # frequencies depend on the sequence length
_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")  # transformers fills original_max_position_embeddings


def default_inv_freq(dim: int, theta: float, device, dtype: torch.dtype) -> torch.Tensor:
    """Default RoPE inverse frequencies ``[dim / 2]``: ``theta ** (-2i / dim)``, computed in ``dtype``."""
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(dtype) / dim
    return 1.0 / (theta**exponent)


def _cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """``cos, sin [b, s, 2 * len(inv_freq)]`` (rotate-half layout) for ``position_ids [b, s]``, in ``inv_freq``'s
    dtype, times ``scaling``, then cast to ``dtype`` (as transformers' rotary embeddings)."""
    freqs = position_ids[..., None].to(inv_freq.dtype) * inv_freq  # [b, s, r / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [b, s, r]
    cos, sin = emb.cos(), emb.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos.to(dtype), sin.to(dtype)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default RoPE ``cos, sin [batch, seq, head_dim]`` for ``position_ids [batch, seq]`` (global positions).

    Computed in float32 exactly as transformers does (float64 for float64 models), then cast to ``dtype``.
    """
    inv_freq = default_inv_freq(head_dim, theta, position_ids.device, _accumulation_dtype(dtype))
    return _cos_sin(position_ids, inv_freq, 1.0, dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x_BSHD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [batch, seq, heads, head_dim]`` by ``cos, sin [batch, seq, rotary_dim]``.

    With ``rotary_dim < head_dim`` (partial RoPE, as HF's Qwen3.5 / GLM) only the leading ``rotary_dim`` dims
    are rotated; the rest pass through."""
    cos, sin = cos_BSD.unsqueeze(2), sin_BSD.unsqueeze(2)  # (b, s, 1, r)
    rotary = cos.shape[-1]
    if rotary == x_BSHD.shape[-1]:
        return x_BSHD * cos + rotate_half(x_BSHD) * sin
    x_rot, x_pass = x_BSHD[..., :rotary], x_BSHD[..., rotary:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def rope_type(config) -> str:
    """The RoPE variant of a DecoderConfig: ``config.rope_parameters["rope_type"]``, ``"default"`` without one."""
    return (config.rope_parameters or {}).get("rope_type", "default")


def transformers_rope_config(config):
    """The minimal ``transformers.PreTrainedConfig`` that ``ROPE_INIT_FUNCTIONS`` read, from a DecoderConfig.

    Carries ``hidden_size``, ``num_attention_heads``, ``head_dim``, ``max_position_embeddings`` and
    ``rope_parameters`` (with ``rope_theta`` and ``partial_rotary_factor``). Imports transformers.
    Raises:
        ValueError: a variant that needs ``max_position_embeddings`` (dynamic; llama3 / yarn / longrope without
            ``original_max_position_embeddings``; yarn / longrope without ``factor``) and it is None.
    """
    from transformers import PreTrainedConfig

    kind = rope_type(config)
    params = copy.deepcopy(config.rope_parameters or {})
    params.update(rope_type=kind, rope_theta=config.rope_theta, partial_rotary_factor=config.partial_rotary_factor)
    needs_length = (kind == "dynamic"
                    or (kind in _ORIGINAL_LENGTH_TYPES and params.get("original_max_position_embeddings") is None)
                    or (kind in ("yarn", "longrope") and params.get("factor") is None))
    if needs_length and config.max_position_embeddings is None:
        raise ValueError(f"rope_type={kind!r} with rope_parameters={config.rope_parameters} needs "
                         "max_position_embeddings, which is None")
    return PreTrainedConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                            head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
                            rope_parameters=params)


# position_ids tensor -> (its version counter, the group, the all-reduced length); entries go with the tensor
_GLOBAL_LENGTHS = WeakIdKeyDictionary()


def global_seq_len(position_ids: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``max(position_ids) + 1`` over the whole sequence: all-reduced (MAX) over ``group`` when it has more than
    one rank. A 0-dim tensor on ``position_ids``' device (no host sync).

    The all-reduced length is kept per ``position_ids`` tensor (and group) until the tensor changes in place or is
    freed: every layer of a forward, and its recomputation, gets the same tensor, so a forward all-reduces once,
    not once per layer. Every rank of the group calls with its own tensor of the same history, so all hit or all
    miss and the collective stays matched."""
    if group_size(group) <= 1:
        return position_ids.max() + 1
    cached = _GLOBAL_LENGTHS.get(position_ids)
    if cached is not None and cached[0] == position_ids._version and cached[1] is group:
        return cached[2]
    seq_len = position_ids.max() + 1
    dist.all_reduce(seq_len, op=dist.ReduceOp.MAX, group=group)
    _GLOBAL_LENGTHS[position_ids] = (position_ids._version, group, seq_len)
    return seq_len


class RotaryEmbedding:
    """The RoPE tables of one architecture: ``cos, sin [batch, seq, rotary_dim]`` at global positions.

    A plain object (not a Module: nothing to save or shard). ``rotary_dim = config.rotary_dim`` leading dims
    of each head are rotated (partial RoPE), the rest pass through :func:`apply_rope` unchanged. The inverse
    frequencies (``[rotary_dim / 2]``) are computed once on the CPU in float32, as transformers does, and kept
    per device and accumulation dtype; ``attention_scaling`` multiplies cos and sin (yarn, longrope).

    Raises:
        ValueError: a ``rope_type`` not in :data:`ROPE_TYPES`, or frequencies that do not cover ``rotary_dim``.
    """

    def __init__(self, config) -> None:
        self.rotary_dim = config.rotary_dim
        self.theta = config.rope_theta
        self.rope_type = rope_type(config)
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r} is not supported; DecoderLM implements {ROPE_TYPES}")
        self.attention_scaling = 1.0
        self._tables: dict[tuple, torch.Tensor] = {}  # (name, device, dtype) -> inverse frequencies
        self._base = self._long = None
        if self.rope_type == "default":
            return
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        self._init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        self._hf_config = transformers_rope_config(config)
        with torch.device("cpu"):  # also under a meta-device model construction
            self._base, self.attention_scaling = self._init_fn(self._hf_config, "cpu")
            if self.rope_type == "longrope":  # the long factors, as transformers' longrope_frequency_update
                self._original = self._hf_config.rope_parameters["original_max_position_embeddings"]
                self._long, _ = self._init_fn(self._hf_config, "cpu", seq_len=self._original + 1)
        self.attention_scaling = float(self.attention_scaling)
        if 2 * self._base.shape[0] != self.rotary_dim:
            raise ValueError(f"rope_type={self.rope_type!r} gives {self._base.shape[0]} frequencies for "
                             f"rotary_dim={self.rotary_dim} (head_dim={config.head_dim} x partial_rotary_factor="
                             f"{config.partial_rotary_factor})")

    @property
    def is_dynamic(self) -> bool:
        """Whether the frequencies depend on the sequence length (dynamic NTK, longrope)."""
        return self.rope_type in DYNAMIC_ROPE_TYPES

    def _table(self, name: str, device, dtype: torch.dtype) -> torch.Tensor:
        key = (name, str(device), dtype)
        if key not in self._tables:
            if name == "default":
                table = default_inv_freq(self.rotary_dim, self.theta, device, dtype)
            else:
                table = (self._base if name == "base" else self._long).to(device=device, dtype=dtype)
            self._tables[key] = table
        return self._tables[key]

    def inv_freq(self, position_ids: torch.Tensor, dtype: torch.dtype, group=None) -> torch.Tensor:
        """Inverse frequencies ``[rotary_dim / 2]`` in ``dtype`` for this call's global ``position_ids``.

        ``dynamic``: transformers' growth rule, recomputed at ``seq_len = global max(position_ids) + 1`` when it
        exceeds ``max_position_embeddings``; ``longrope``: the long factors when ``seq_len`` exceeds
        ``original_max_position_embeddings``, else the short ones. ``group`` (the SP group) makes ``seq_len``
        global with one tiny all-reduce per ``position_ids`` tensor (:func:`global_seq_len`: once per forward).
        """
        device = position_ids.device
        if self.rope_type == "default":
            return self._table("default", device, dtype)
        inv_freq = self._table("base", device, dtype)
        if not self.is_dynamic:
            return inv_freq
        seq_len = global_seq_len(position_ids, group)
        if self.rope_type == "longrope":
            return torch.where(seq_len > self._original, self._table("long", device, dtype), inv_freq)
        grown, _ = self._init_fn(self._hf_config, device, seq_len=seq_len)
        return torch.where(seq_len > self._hf_config.max_position_embeddings, grown.to(dtype), inv_freq)

    def __call__(self, position_ids: torch.Tensor, dtype: torch.dtype, group=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [batch, seq, rotary_dim]`` in ``dtype`` for global ``position_ids [batch, seq]``.

        Computed in float32 (float64 for float64 models), times ``attention_scaling``, then cast to ``dtype``.
        ``group``: the sequence-parallel group, used by the length-dependent variants only.
        """
        inv_freq = self.inv_freq(position_ids, _accumulation_dtype(dtype), group)
        return _cos_sin(position_ids, inv_freq, self.attention_scaling, dtype)


def _unsupported(model_type: str, field: str, value, why: str) -> ValueError:
    return ValueError(f"{model_type} checkpoint field {field}={value!r} is not supported: {why}")


def rope_fields_from_hf(hf: dict, model_type: str) -> dict:
    """``rope_theta``, ``rope_parameters`` and ``partial_rotary_factor`` for a DecoderConfig from an HF config dict.

    Reads transformers 5's ``rope_parameters`` or 4.x's ``rope_scaling`` (which wins when set, as in
    transformers) plus top-level ``rope_theta`` / ``partial_rotary_factor``. ``rope_parameters`` keeps every
    other key (``factor``, ``mrope_section``, ...) and is None for plain default RoPE.
    Raises:
        ValueError: an unknown ``rope_type`` or per-layer-type RoPE parameters, naming them.
    """
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    spec = copy.deepcopy(hf.get(field) or {})
    nested = sorted(k for k, v in spec.items() if isinstance(v, dict))
    if nested:
        raise _unsupported(model_type, field, spec, f"per-layer-type RoPE ({nested}) is not implemented")
    legacy = spec.pop("type", "default")
    kind = spec.pop("rope_type", legacy)
    if kind not in ROPE_TYPES:
        raise _unsupported(model_type, f"{field}.rope_type", kind, f"DecoderLM implements {ROPE_TYPES}")
    theta = float(spec.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
    partial = spec.pop("partial_rotary_factor", None)
    partial = float(partial if partial is not None else hf.get("partial_rotary_factor", 1.0))
    if kind in _ORIGINAL_LENGTH_TYPES and hf.get("original_max_position_embeddings") is not None:
        # transformers' standardize_rope_params gives a top-level value priority (Phi3-style configs)
        spec["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    params = {"rope_type": kind, **spec} if kind != "default" or spec else None
    return dict(rope_theta=theta, rope_parameters=params, partial_rotary_factor=partial)


def rope_fields_to_hf(config, *, with_partial: bool = False) -> dict:
    """The RoPE entries of ``config.json`` that transformers 5 (``rope_parameters``) and 4.x (``rope_theta``,
    ``rope_scaling``) read back into the same RoPE.

    ``partial_rotary_factor`` is written when it is not 1, or always with ``with_partial`` (for a class whose
    default is not 1, as Qwen3.5's 0.25)."""
    params = {"rope_type": rope_type(config), **copy.deepcopy(config.rope_parameters or {}),
              "rope_theta": config.rope_theta}
    if with_partial or config.partial_rotary_factor != 1.0:
        params["partial_rotary_factor"] = config.partial_rotary_factor
    scaling = copy.deepcopy(params) if params["rope_type"] != "default" else None
    return {"rope_theta": config.rope_theta, "rope_parameters": params, "rope_scaling": scaling}


__all__ = ["DYNAMIC_ROPE_TYPES", "ROPE_TYPES", "RotaryEmbedding", "apply_rope", "global_seq_len", "rope_cos_sin",
           "rope_fields_from_hf", "rope_fields_to_hf", "rope_type", "transformers_rope_config"]
