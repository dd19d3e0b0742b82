"""Workers for tests/test_expert_parallel.py (gloo ranks, float64): expert parallelism == one process.

Each worker builds the same seeded model and batch, computes the one-process loss and gradients itself, then
runs its sequence shard with the routed experts sharded over the WORLD group (the EP group = the SP group: rank
``p`` keeps experts ``[p X / P, (p + 1) X / P)``). Non-expert gradients are summed over the ranks (each holds
its tokens' share); an expert's gradient is complete on its owner and must equal the one-process gradient's
rows for that rank's experts without any reduction. Cases: DeepSeek-V3-shaped MLA + MoE (random and skewed
routing: a score-correction bias that sends every token to rank 0's experts, so the other ranks' experts are
empty and their splits zero), Qwen3.5-MoE (softmax routing), through the MLP tiles and activation
checkpointing, and decoding (rows the same on every rank: local experts + a sum over the group).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lightning_longctx.longstraw import LossOptions, StepGroups, StepMemory
from lightning_longctx.models import MemoryConfig
from lightning_longctx.models.moe import Experts, enable_expert_parallel, is_expert_parameter, tokens_replicated
from lightning_longctx.parallel import set_sequence_parallel_group, shard_batch
from mla_workers import mla_config, mla_model, qwen_moe_config
from models_common import assert_close_rel, assert_grads_match, copy_model, grads, greedy_by_full_forward, random_batch

TOL = 1e-10


def _skew(model) -> None:
    """Every token's choice: experts 0 and 1 (rank 0's on any world) through the score-correction bias (the
    choice only; the weights stay the router's)."""
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
                b[:2] = 100.0


def _local_rows(model, name: str, full: torch.Tensor) -> torch.Tensor:
    owner = model.get_submodule(name.rpartition(".")[0])
    return full[owner.first_expert:owner.first_expert + len(owner.local_experts)]


class _KeysRead:
    """``safe_open`` as :mod:`lightning_longctx.models.hf_io` uses it, recording the keys whose data it read."""

    def __init__(self, real):
        self.real, self.keys = real, []

    def __call__(self, *args, **kwargs):
        spy, handle = self, self.real(*args, **kwargs)

        class Handle:
            def __enter__(self):
                self.f = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, key):
                spy.keys.append(key)
                return self.f.get_tensor(key)

            def get_slice(self, key):
                spy.keys.append(key)
                return self.f.get_slice(key)

        return Handle()


def _read_expert_shard(reference, memory, rank, world):
    """``reference`` saved as a transformers checkpoint, read back with ``expert_shard=(rank, world)``; checks
    that no other rank's expert was read."""
    import tempfile

    from lightning_longctx.models import DecoderLM, hf_io

    directory = tempfile.mkdtemp(prefix=f"ep_shard_rank{rank}_")
    reference.save_pretrained(directory)
    spy, real = _KeysRead(hf_io.safe_open), hf_io.safe_open
    hf_io.safe_open = spy
    try:
        model = DecoderLM.from_pretrained(directory, memory, expert_shard=(rank, world))
    finally:
        hf_io.safe_open = real
    per_rank = reference.config.n_routed_experts // world
    mine = range(rank * per_rank, (rank + 1) * per_rank)
    read = {int(k.split(".mlp.experts.")[1].split(".")[0]) for k in spy.keys if ".mlp.experts." in k}
    assert read == set(mine), f"rank {rank} read experts {sorted(read)}, owns {list(mine)}"
    return model


def _check_model(rank, world, group, config, memory, skew=False, read_shard=False):
    """EP forward / backward == one process; ``read_shard``: the EP model read from a checkpoint with
    ``from_pretrained(expert_shard=(rank, world))`` (each rank reads only its experts) instead of sliced."""
    reference = mla_model(config)
    if skew:
        _skew(reference)
    ids, labels = random_batch(config, seq=22)
    model = _read_expert_shard(reference, memory, rank, world) if read_shard else copy_model(reference, memory)
    out = reference(ids, labels=labels)
    out.loss.backward()
    want_loss, want = out.loss.detach(), grads(reference)
    set_sequence_parallel_group(model, group)
    sharded = enable_expert_parallel(model, group)
    assert sharded == sum(isinstance(m, Experts) for m in reference.modules()) > 0
    out = model(**shard_batch(ids, labels, sp_rank=rank, sp_size=world))
    out.loss.backward()
    loss, got = out.loss.detach().clone(), grads(model)
    dense = {n: g for n, g in got.items() if not is_expert_parameter(model, n)}
    for g in (loss, *dense.values()):
        dist.all_reduce(g, group=group)
    what = f"EP world={world} {config.shape_model_type()} {memory} skew={skew}"
    assert_close_rel(loss, want_loss, TOL, f"{what}: summed loss shares")
    # a rank whose experts no token chose gets no gradient for them (None): the one process's rows are zero there
    experts = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()
               if is_expert_parameter(model, n)}
    assert experts and all(g.shape[0] == config.n_routed_experts // world for g in experts.values())
    assert_grads_match(dense, {n: want[n] for n in dense}, TOL, f"{what}: non-expert parameters")
    assert_grads_match(experts, {n: _local_rows(model, n, want[n]) for n in experts}, TOL, f"{what}: experts")
    if skew and rank > 0:  # no token chose this rank's experts: no rows came, no gradient arrived
        assert all(p.grad is None for n, p in model.named_parameters() if is_expert_parameter(model, n)), what


def _check_decode(rank, world, group):
    """Rows the same on every rank (decoding): each rank's experts on all rows, summed over the group."""
    config = mla_config()
    reference = mla_model(config)
    moe = next(m for m in reference.modules() if isinstance(m, Experts))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, config.hidden_size, generator=g, dtype=torch.float64)
    indices = torch.stack([torch.randperm(config.n_routed_experts, generator=g)[:2] for _ in range(5)])
    weights = torch.rand(5, 2, generator=g, dtype=torch.float64)
    with torch.no_grad():
        want = moe(x, indices, weights)
        twin = copy_model(reference, None)
        enable_expert_parallel(twin, group)
        mine = next(m for m in twin.modules() if isinstance(m, Experts))
        with tokens_replicated():
            got = mine(x, indices, weights)
    assert_close_rel(got, want, TOL, f"EP world={world} replicated rows (decode)")


def check_all(rank, world):
    group = dist.group.WORLD
    cases = [(mla_config(), MemoryConfig(), False), (mla_config(), MemoryConfig(head_chunk_size=1), True),
             (qwen_moe_config(), MemoryConfig(head_chunk_size=1), False)]
    if world == 2:  # the recompute replays the count exchange and both row exchanges in backward; MLP tiles
        cases.append((mla_config(), MemoryConfig(activation_checkpointing=True, mlp_chunk_size=3), False))
    for config, memory, skew in cases:
        _check_model(rank, world, group, config, memory, skew)
    _check_model(rank, world, group, qwen_moe_config(), MemoryConfig(), read_shard=True)
    _check_decode(rank, world, group)
    return True


# ------------------------------------------------------------------ Trainer(strategy=UlyssesStrategy(expert_parallel))
def _moe_sft_config():
    """The MLA + MoE shape on the strategy tests' data (vocab 32 tokens of it are used)."""
    return mla_config()


CLIP_NORM = 0.05  # Trainer(gradient_clip_val=...) in the EP strategy runs: below the step-1 norm, so it clips


def trainer_checks(rank, world, ckpt_dir):
    """Three SGD-with-momentum steps under ``UlyssesStrategy(expert_parallel=True)``, clipped by
    ``gradient_clip_val`` (the norm over both meshes, :mod:`lightning_longctx.parallel.grad_norm`) (FSDP2: the experts
    DTensors over sp, FSDP-sharded over dp) == one process (float64): step-1 gradients and the parameters after
    3 steps, the experts compared whole (``full_tensor``); world 2 = dp1 x sp2, world 4 = dp2 x sp2 (the experts'
    gradients summed over the dp replicas). World 2 also saves at step 2 and resumes: bitwise the uninterrupted
    run (the distributed checkpoint's experts are DTensors at their global index, so ranks never overwrite each
    other's experts under the same key)."""
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_longctx.training import UlyssesStrategy
    from strategy_workers import bitwise_equal, fit, max_error, reference_run

    class Layout(L.Callback):  # what the strategy made of the experts: the local slice of a 2-D DTensor
        seen = None

        def on_train_start(self, trainer, pl_module):
            experts = [m for m in pl_module.modules() if isinstance(m, Experts)]
            self.seen = [(type(m.gate_up_proj).__name__, tuple(m.local_weights()[0].shape), m.first_expert,
                          tuple(m.gate_up_proj.device_mesh.mesh_dim_names)) for m in experts]

    cfg = _moe_sft_config()
    dp, batch = (1, 4) if world == 2 else (2, 2)
    grads0, loss0, final = reference_run([(dp, batch)] * 3, shuffle=True, cfg=cfg, dtype=torch.float64,
                                         clip_norm=CLIP_NORM)
    out = {"norm0": float(torch.nn.utils.get_total_norm(list(grads0.values())))}
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    layout = Layout()
    callbacks = [layout, saver] if world == 2 else [layout]
    params, probe = fit(UlyssesStrategy(sp_size=2, expert_parallel=True), world, batch, cfg=cfg,
                        dtype=torch.float64, callbacks=callbacks, gradient_clip_val=CLIP_NORM)
    out["fit"] = (max_error(probe.grads, grads0), max_error(params, final), abs(probe.loss - loss0))
    out["layout"] = layout.seen
    if world == 2:  # sharding="replicate": the broadcast of replicas must leave each rank's experts its own
        replicas, probe = fit(UlyssesStrategy(sp_size=2, expert_parallel=True, sharding="replicate"), world, batch,
                              cfg=cfg, dtype=torch.float64, gradient_clip_val=CLIP_NORM)
        out["replicate"] = (max_error(probe.grads, grads0), max_error(replicas, final), abs(probe.loss - loss0))
        resumed, _ = fit(UlyssesStrategy(sp_size=2, expert_parallel=True), world, batch, cfg=cfg,
                         dtype=torch.float64, ckpt_path=f"{ckpt_dir}/step=2.ckpt", gradient_clip_val=CLIP_NORM)
        out["resume_bitwise"] = bitwise_equal(resumed, params)
    return out


# ---------------------------------------------------------------------------- LongStraw with expert parallelism
def _assert_ep_grads(model, want, world, label):
    """Non-expert gradients == one process (the step summed them over SP); each rank's experts == the one
    process' rows of them (complete on their owner, never summed over the group)."""
    from test_longstraw import assert_grads_close

    full = {}
    for n, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        if is_expert_parameter(model, n) and not hasattr(p, "full_tensor"):
            want = {**want, n: _local_rows(model, n, want[n])}
        full[n] = g
    assert_grads_close(full, want, label=label)


def longstraw_checks(rank, world):
    """``longstraw_step(loss=LossOptions(prompt_grad="full"))`` with expert parallelism == full autograd over
    cat(P, r_i) (float64, 1e-8): MLA + MoE (random and skewed routing), Qwen3.5-MoE, GLM-5's DSA + MoE, and
    (2 ranks) FSDP2 with
    the experts' 2-D shards; the global grad norm == the one process' norm; greedy ``sample`` == greedy full
    forwards."""
    from dsa_workers import GLM, dsa_config, dsa_model
    from lightning_longctx.longstraw import longstraw_step, sample
    from lightning_longctx.parallel.grad_norm import global_grad_norm
    from test_longstraw import MAX_LEN, make_group, reference

    group = dist.group.WORLD
    cases = [(mla_model, mla_config(), 3, 23, False), (mla_model, mla_config(), 2, 17, True),
             (mla_model, qwen_moe_config(), 3, 70, False),
             (dsa_model, dsa_config(**GLM), 3, 23, False)]  # GLM-5 DSA (IndexShare) + MoE
    for case, (build, config, g, prompt_len, skew) in enumerate(cases):
        reference_model = build(config)
        if skew:
            _skew(reference_model)
        model = copy_model(reference_model, MemoryConfig(head_chunk_size=1))
        assert enable_expert_parallel(model, group) > 0
        prompt, responses, advantages = make_group(g, prompt_len=prompt_len, seed=case)
        want_loss, want = reference(reference_model, prompt, responses, advantages, loss_type="token_mean")
        out = longstraw_step(model, prompt, responses, advantages, loss=LossOptions(max_response_length=MAX_LEN),
                             memory=StepMemory(state_segment=64), groups=StepGroups(sp_group=group))
        assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss), (case, out.loss, want_loss)
        _assert_ep_grads(model, want, world, f"EP LongStraw case {case} rank {rank}")
        for norm_type in (2.0, 3.0, math.inf):  # plain expert shards: norm ** p summed (max for inf) over EP
            want_norm = torch.nn.utils.get_total_norm(list(want.values()), norm_type)
            assert_close_rel(global_grad_norm(list(model.parameters()), norm_type), want_norm, 1e-10,
                             f"EP {norm_type}-norm case {case}")
    if world == 2:
        _longstraw_fsdp(rank, world)
    prompt, _, _ = make_group(1, prompt_len=21, seed=3)
    reference_model = mla_model(mla_config())
    model = copy_model(reference_model, None)
    enable_expert_parallel(model, group)
    got = sample(model, prompt, 2, max_new_tokens=4, temperature=0.0, group=group)
    assert [r.tolist() for r in got] == [greedy_by_full_forward(reference_model, prompt, 4)] * 2
    return True


def _longstraw_fsdp(rank, world):
    from lightning_longctx.longstraw import longstraw_step
    from lightning_longctx.parallel import build_dp_sp_mesh
    from lightning_longctx.parallel.grad_norm import clip_grad_value_, clip_grads_by_mesh_, global_grad_norm
    from lightning_longctx.training.parallelize import (
        fsdp_mesh,
        mixed_precision_policy,
        register_prefix_state_methods,
        shard_modules,
    )
    from test_longstraw import make_group, reference

    prompt, responses, advantages = make_group(3, prompt_len=23, seed=9)
    reference_model = mla_model(mla_config())
    want_loss, want = reference(reference_model, prompt, responses, advantages, loss_type="token_mean")
    model = copy_model(reference_model, MemoryConfig(head_chunk_size=1))
    enable_expert_parallel(model, dist.group.WORLD)
    shard_modules(model, [model], sharding="fsdp", mesh=fsdp_mesh("fsdp", "cpu"),
                  mp_policy=mixed_precision_policy(None), expert_mesh=build_dp_sp_mesh(world))
    register_prefix_state_methods([model])
    out = longstraw_step(model, prompt, responses, advantages, memory=StepMemory(measure_memory=False),
                         groups=StepGroups(sp_group=dist.group.WORLD))
    assert abs(out.loss - want_loss) <= 1e-8 * abs(want_loss), (out.loss, want_loss)
    _assert_ep_grads(model, want, world, f"EP LongStraw FSDP2 rank {rank}")
    want_norm = torch.nn.utils.get_total_norm(list(want.values()))
    norm = global_grad_norm(list(model.parameters()))
    assert_close_rel(norm, want_norm, 1e-10, "EP FSDP2 grad norm")
    # clipping to half the norm scales every gradient by torch's coefficient, the DTensors of both meshes included
    clip_grads_by_mesh_(list(model.parameters()), float(norm) / 2, norm)
    coef = float(norm) / 2 / (float(norm) + 1e-6)  # clip_grads_with_norm_'s max_norm / (total_norm + 1e-6)
    clipped = {n: w * coef for n, w in want.items()}
    _assert_ep_grads(model, clipped, world, f"EP FSDP2 clipped rank {rank}")
    # the max norm and clipping by value over both meshes (Trainer(gradient_clip_algorithm="value"))
    largest = torch.nn.utils.get_total_norm(list(clipped.values()), math.inf)
    assert_close_rel(global_grad_norm(list(model.parameters()), math.inf), largest, 1e-10, "EP FSDP2 inf-norm")
    cap = float(largest) / 3
    clip_grad_value_(list(model.parameters()), cap)
    _assert_ep_grads(model, {n: w.clamp(-cap, cap) for n, w in clipped.items()}, world, f"EP value-clipped {rank}")
