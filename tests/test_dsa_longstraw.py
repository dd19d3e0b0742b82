"""LongStraw on DeepSeek-sparse-attention models (GLM-5 ``glm_moe_dsa`` with IndexShare, DeepSeek-V3.2) == full
autograd over the concatenated sequences, and decoding == full forwards.

The prompt state of a DSA layer is its latent (a leaf) and, on a full layer, the prompt's index keys (graph-free);
a replay selects among ``[prompt | branch]`` keys (global top-k), the grouped backward recomputes the prompt's own
top-k (a shared layer's from its source's input), decoding merges every rank's top-k candidates of the prompt with
the rows' own. Tiny float64 models (:mod:`dsa_workers`: 3 layers, ``index_topk = 5`` of 20-30 keys, so most keys
are dropped; GLM ``full, shared, full``), the reference is ``test_longstraw.reference`` (plain ``forward`` over each
``cat(P, r_i)``, TRL's GRPO formulas): loss and every parameter's gradient at 1e-8 relative on 1, 2 and 4 gloo
ranks (4: ``-m slow``), with LoRA (on the prompt, and prefix-frozen), replay checkpointing, segment
checkpoints and the prompt state offloaded to the host (latents, index keys, latent sums); on 2 ranks also
FSDP2-sharded parameters. The indexer gets no gradient (None, as transformers' training forward:
tests/test_dsa.py). Greedy ``sample`` == greedy decoding by full forwards, and the sampling
distribution of every step == the full forward's (1e-10).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from dsa_workers import DSV32, GLM, dsa_config, dsa_model
from lightning_longctx.longstraw import LossOptions, StepGroups, StepMemory, longstraw_step, sample
from lightning_longctx.longstraw.offload import simulated_streams
from lightning_longctx.models.lora_attach import adapters_from_position
from lightning_longctx.parallel import set_sequence_parallel_group
from models_common import greedy_by_full_forward, single_thread  # noqa: F401 - single_thread is an autouse fixture
from test_longstraw import MAX_LEN, assert_grads_close, make_group, policy_inputs, reference

MODELS = {"glm_index_share": GLM, "deepseek_v32": DSV32}
CASES = {  # loss type, G, prompt length, StepMemory options, model
    "glm_off_policy": ("token_mean", 3, 23, {}, "glm_index_share"),
    "v32_replay_checkpointing": ("seq_mean_token_mean", 4, 18, {"replay_checkpointing": True}, "deepseek_v32"),
    "glm_segments_offload": ("seq_mean_token_sum_norm", 2, 27, {"prompt_checkpoint_every": 2,
                                                                 "offload_checkpoints": True}, "glm_index_share"),
    # the latents, index keys and latent sums on the host, copies deferred until waited on (simulated_streams)
    "v32_prompt_cache_offload": ("token_mean", 3, 25, {"offload_prompt_cache": True, "replay_checkpointing": True},
                                 "deepseek_v32"),
    "glm_prompt_cache_offload": ("token_mean", 2, 21, {"offload_prompt_cache": True}, "glm_index_share"),
}
LORA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def _model(kind, **overrides):
    return dsa_model(dsa_config(**{**MODELS[kind], **overrides}))


def _indexer_grads(model):
    return {n: p.grad for n, p in model.named_parameters() if ".indexer." in n}


def _step_and_reference(kind, loss_type, g, prompt_len, memory, *, off_policy=False, lora=None, group=None, seed=0):
    """(out, reference loss, reference grads, the stepped model)."""
    model, twin = _model(kind), _model(kind)
    if lora is not None:
        for m in (model, twin):
            m.add_lora(4, 8.0, lora["targets"], on_prompt=lora["on_prompt"])
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        twin.load_state_dict(model.state_dict())
    prompt, responses, advantages = make_group(g, prompt_len=prompt_len, seed=seed)
    old = ref = None
    if off_policy:
        old, ref = policy_inputs(model, prompt, responses, perturb=0.3)
    frozen_prompt = lora is not None and not lora["on_prompt"]
    with adapters_from_position(twin, prompt.numel()) if frozen_prompt else contextlib.nullcontext():
        want_loss, want = reference(twin, prompt, responses, advantages, loss_type=loss_type, old=old, ref=ref,
                                    beta=0.05 if off_policy else 0.0)
    with simulated_streams() if memory.get("offload_prompt_cache") else contextlib.nullcontext():
        out = longstraw_step(model, prompt, responses, advantages, old_logprobs=old, ref_logprobs=ref,
                             loss=LossOptions(loss_type=loss_type, beta=0.05 if off_policy else 0.0,
                                              max_response_length=MAX_LEN),
                             memory=StepMemory(logits_chunk_size=4, **memory), groups=StepGroups(sp_group=group))
    return out, want_loss, want, model


def _check(out, want_loss, want, model, label):
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss) + 1e-14, (label, out.loss, want_loss)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys(), (label, sorted(got.keys() ^ want.keys()))
    assert_grads_close(got, want, label=label)
    assert all(g is None for g in _indexer_grads(model).values()), f"{label}: the indexer got a gradient"


@pytest.mark.parametrize("case", list(CASES))
def test_dsa_grouped_step_equals_full_autograd(case):
    loss_type, g, prompt_len, memory, kind = CASES[case]
    out, want_loss, want, model = _step_and_reference(kind, loss_type, g, prompt_len, memory,
                                                      off_policy=case == "glm_off_policy")
    assert any(".self_attn.kv_a_proj_with_mqa." in n for n in want) and any("experts.gate_up_proj" in n for n in want)
    _check(out, want_loss, want, model, case)


def test_the_sparsity_matters_in_these_steps():
    """The same weights selecting every key (dense MLA) give another gradient: the tests above test the top-k."""
    loss_type, g, prompt_len, memory, kind = CASES["glm_off_policy"]
    _, _, sparse, _ = _step_and_reference(kind, loss_type, g, prompt_len, memory)
    prompt, responses, advantages = make_group(g, prompt_len=prompt_len)
    _, dense = reference(_model(kind, index_topk=64), prompt, responses, advantages, loss_type=loss_type)
    name = "model.layers.2.self_attn.kv_a_proj_with_mqa.weight"
    assert (sparse[name] - dense[name]).norm() > 1e-3 * dense[name].norm()


@pytest.mark.parametrize("on_prompt", [True, False], ids=["on_prompt", "prefix_frozen"])
def test_dsa_grouped_step_with_lora_equals_full_autograd(on_prompt):
    """Adapters on every MLA projection (kv_b_proj's folded into the absorbed weight); prefix-frozen ones (not on
    kv_b_proj) act on the responses only, so the detached step is exact."""
    targets = LORA_TARGETS if on_prompt else [t for t in LORA_TARGETS if t != "kv_b_proj"]
    out, want_loss, want, model = _step_and_reference("glm_index_share", "token_mean", 3, 21, {},
                                                      lora={"targets": targets, "on_prompt": on_prompt})
    assert want and all("lora_" in n for n in want)
    _check(out, want_loss, want, model, f"LoRA on_prompt={on_prompt}")


def test_segment_checkpoints_that_lose_a_shared_layers_source_are_refused_before_any_work():
    model = _model("glm_index_share", num_hidden_layers=4, indexer_types=["full", "full", "shared", "shared"])
    prompt, responses, advantages = make_group(2, prompt_len=15)
    with pytest.raises(ValueError, match="prompt_checkpoint_every=2: DSA layer 2 shares layer 1's top-k"):
        longstraw_step(model, prompt, responses, advantages, memory=StepMemory(prompt_checkpoint_every=2))
    assert all(p.grad is None for p in model.parameters())


def test_a_prefix_frozen_kv_b_adapter_is_refused_before_any_work():
    model = _model("glm_index_share")
    model.add_lora(4, 8.0, ["kv_b_proj", "o_proj"], on_prompt=False)
    prompt, responses, advantages = make_group(2, prompt_len=15)
    with pytest.raises(ValueError, match=r"DSA layers \[0, 1, 2\] have a prefix-frozen .* kv_b_proj"):
        longstraw_step(model, prompt, responses, advantages)
    with pytest.raises(ValueError, match="prefix-frozen"):
        sample(model, prompt, 2, max_new_tokens=3)
    assert all(p.grad is None for p in model.parameters())


def _check_sampling(model, prompt, group=None):
    """Greedy ``sample`` == greedy full forwards; at temperature 1 every step's distribution == the full
    forward's over ``[prompt | response so far]`` (the decoded selections are the full forward's)."""
    steps = 6
    got = sample(model, prompt, 2, max_new_tokens=steps, temperature=0.0, group=group)
    set_sequence_parallel_group(model, None)  # the references: one process's forward over the whole sequence
    assert [r.tolist() for r in got] == [greedy_by_full_forward(model, prompt, steps)] * 2
    seen = {}
    drawn = sample(model, prompt, 3, max_new_tokens=steps, temperature=1.0, group=group,
                   generator=torch.Generator().manual_seed(5),
                   on_step=lambda step, rows, probs: seen.update({(step, int(r)): p for r, p in zip(rows, probs)}))
    set_sequence_parallel_group(model, None)
    s = prompt.numel()
    with torch.no_grad():
        for row, response in enumerate(drawn):
            logits = model(torch.cat([prompt, response])[None]).logits[0, s - 1:s - 1 + response.numel()]
            want = F.softmax(logits.double(), dim=-1)
            for step in range(response.numel()):
                torch.testing.assert_close(seen[(step, row)], want[step], atol=1e-10, rtol=0)


@pytest.mark.parametrize("kind", list(MODELS))
def test_greedy_sample_equals_decoding_by_full_forwards(kind):
    prompt, _, _ = make_group(1, prompt_len=20)
    _check_sampling(_model(kind), prompt)


def _sp_worker(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    for seed, case in enumerate(CASES):
        loss_type, g, prompt_len, memory, kind = CASES[case]
        out, want_loss, want, model = _step_and_reference(kind, loss_type, g, prompt_len, memory, group=group,
                                                          seed=seed)
        _check(out, want_loss, want, model, f"{case} rank {rank}/{world}")
    out, want_loss, want, model = _step_and_reference("glm_index_share", "token_mean", 3, 21, {}, group=group,
                                                      lora={"targets": LORA_TARGETS, "on_prompt": True})
    _check(out, want_loss, want, model, f"LoRA rank {rank}/{world}")
    prompt, _, _ = make_group(1, prompt_len=23, seed=3)
    for kind in MODELS:
        _check_sampling(_model(kind), prompt, group)
    if world == 2:  # FSDP2-sharded parameters: the grouped backward's selection and recomputes inside FSDP's hooks
        _fsdp_step(rank, group)
    return True


def _fsdp_step(rank, group):
    from lightning_longctx.training.parallelize import (
        fsdp_mesh,
        mixed_precision_policy,
        register_prefix_state_methods,
        shard_modules,
    )

    prompt, responses, advantages = make_group(3, prompt_len=23, seed=9)
    want_loss, want = reference(_model("glm_index_share"), prompt, responses, advantages, loss_type="token_mean")
    model = _model("glm_index_share")
    shard_modules(model, [model], sharding="fsdp", mesh=fsdp_mesh("fsdp", "cpu"),
                  mp_policy=mixed_precision_policy(None))
    register_prefix_state_methods([model])
    out = longstraw_step(model, prompt, responses, advantages, groups=StepGroups(sp_group=group))
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss), (out.loss, want_loss)
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    assert_grads_close(got, want, label=f"FSDP2 rank {rank}")


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dsa_grouped_step_and_sampling_under_sequence_parallelism(world):
    assert run_distributed(_sp_worker, world, timeout=600) == [True] * world


def test_a_replay_keeps_no_gathered_prompt_latent_between_forward_and_backward():
    """A DSA layer's replay over a long prompt state holds, between its forward and its backward, only this rank's
    shards: the gathered ``[prompt | branch]`` latent is rebuilt in the backward (as MLA), not kept."""
    from lightning_longctx.models.dsa import DSAState
    from lightning_longctx.ops.tracker import MemoryTracker

    attn = _model("deepseek_v32").model.layers[0].self_attn
    prompt_len, n = 2000, 4
    g = torch.Generator().manual_seed(0)
    hidden_p = torch.randn(1, prompt_len, attn.o_proj.out_features, generator=g, dtype=torch.float64)
    with torch.no_grad():
        state = attn.prompt_state(hidden_p, torch.arange(prompt_len)[None])
    state = DSAState(state.latent.requires_grad_(), state.index_keys)
    hidden = torch.randn(1, n, hidden_p.shape[-1], generator=g, dtype=torch.float64, requires_grad=True)
    gathered = (prompt_len + n) * state.latent.shape[-1] * 8
    with MemoryTracker() as tracker:
        out = attn(hidden, torch.arange(prompt_len, prompt_len + n)[None], prefix_state=state)
        held = tracker.current_bytes
        out.sum().backward()
    assert held < gathered / 4, (held, gathered)
    assert state.latent.grad is not None and state.latent.grad.abs().sum() > 0


def test_dsa_prefill_replay_selection_and_decoding_never_read_a_value_on_the_host():
    """On fake tensors (no values: a host read such as ``.item()`` or a boolean-mask index raises), as the
    rehearsal runs them: a prefill returning each layer's state, a replay over it with its backward, the grouped
    backward's selection of a full layer, and a decoding step (bf16, grouped experts)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_longctx.models import DecoderLM
    from lightning_longctx.models.decode import new_decode_cache

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = DecoderLM(dsa_config(**GLM))
    finally:
        torch.set_default_dtype(default)
    for layer in model.layers[1:]:
        layer.mlp.experts.backend = "grouped"  # the loop backend reads the expert counts on the host
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        pos, states, selections = torch.arange(30)[None], [], {}
        with torch.no_grad():
            hidden = model.embed(torch.zeros(1, 30, dtype=torch.long))
            for layer in model.layers:
                hidden_in = hidden
                hidden, state = layer(hidden, pos, return_state=True, dsa_indices=selections)
                states.append(state._replace(latent=state.latent.requires_grad_()))  # LongStraw's leaves
            assert model.layers[2].dsa_selection(hidden_in, pos).shape == (1, 30, 5)
        hidden, selections = model.embed(torch.zeros(1, 5, dtype=torch.long)), {}
        for layer, state in zip(model.layers, states):
            hidden = layer(hidden, torch.arange(30, 35)[None], prefix_state=state, dsa_indices=selections)
        hidden.sum().backward()
        assert all(state.latent.grad.shape == state.latent.shape for state in states)
        caches, selections = [new_decode_cache(layer, 4) for layer in model.layers], {}
        with torch.no_grad():
            rows = model.embed(torch.zeros(2, 1, dtype=torch.long))
            for layer, state, cache in zip(model.layers, states, caches):
                rows = layer.decode_step(rows, torch.full((2, 1), 30), cache, state, dsa_indices=selections)
        assert rows.shape == (2, 1, model.config.hidden_size)
