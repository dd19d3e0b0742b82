"""``torch.compile`` of a decoder layer (what docs/compile.md reports): with the ``aot_eager`` backend (dynamo's
graphs through AOTAutograd, no C++ compile, so it fits the suite) the forward and the input's and every
parameter's gradient equal eager, for a dense Llama layer and an MLA + MoE layer (slow), and under Ulysses on 2
gloo ranks with head chunks (slow). Float32, to 1e-5 relative: AOTAutograd's decomposed backward sums some
attention gradients in another order (1e-7 apart in the MLA layer; the dense layer and the MoE come out
bitwise). Inductor (``backend="inductor"``) is not run here: the same dense layer compiled in ~4 minutes on 2
loaded cores, equal to 1.4e-6 in float32."""

import pytest
import torch

from distributed import run_distributed
from lightning_longctx.models import MemoryConfig
from models_common import single_thread, tiny_config, tiny_model  # noqa: F401

MLA_MOE = dict(kv_lora_rank=12, q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=12, v_head_dim=16,
               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
               first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=2, topk_group=1, norm_topk_prob=True,
               num_key_value_heads=8)


def _layer_step(layer, hidden, position_ids):
    hidden = hidden.detach().clone().requires_grad_()
    layer.zero_grad()
    out = layer(hidden, position_ids)
    out.backward(torch.ones_like(out))
    return [out.detach(), hidden.grad] + [p.grad.clone() for p in layer.parameters()]


def _compiled_equals_eager(layer, hidden, position_ids, tol: float = 1e-5) -> list[str]:
    """The results (output, input gradient, parameter gradients) further than ``tol`` (relative) from eager."""
    torch._dynamo.reset()
    want = _layer_step(layer, hidden, position_ids)
    got = _layer_step(torch.compile(layer, backend="aot_eager"), hidden, position_ids)
    names = ["out", "d hidden"] + [n for n, _ in layer.named_parameters()]
    torch._dynamo.reset()
    return [f"{name}: {(g - w).abs().max().item() / w.abs().max().item():.1e}" for name, g, w in zip(names, got, want)
            if (g - w).abs().max() > tol * w.abs().max()]


@pytest.mark.parametrize("fields, index", [({}, 0), pytest.param(MLA_MOE, 1, marks=pytest.mark.slow)],
                         ids=["llama", "mla_moe"])  # each ~15 s on 2 idle cores
def test_compiled_layer_equals_eager(fields, index):
    config = tiny_config(num_hidden_layers=2, **fields)
    model = tiny_model(config, dtype=torch.float32)
    hidden = model.embed(torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)))
    assert _compiled_equals_eager(model.layers[index], hidden, torch.arange(32)[None]) == []


def _sp_worker(rank, world):
    import torch.distributed as dist

    from lightning_longctx.parallel import set_sequence_parallel_group, shard_sequence

    torch.set_num_threads(1)
    model = tiny_model(tiny_config(num_hidden_layers=1), MemoryConfig(head_chunk_size=1), dtype=torch.float32)
    set_sequence_parallel_group(model, dist.group.WORLD)
    ids = torch.randint(0, 96, (1, 32), generator=torch.Generator().manual_seed(0))
    hidden = model.embed(shard_sequence(ids, rank, world))
    return _compiled_equals_eager(model.layers[0], hidden, torch.arange(rank * 16, rank * 16 + 16)[None])


@pytest.mark.slow  # ~40 s on 2 loaded cores
def test_compiled_layer_under_ulysses_equals_eager():
    assert run_distributed(_sp_worker, 2, timeout=600) == [[], []]
