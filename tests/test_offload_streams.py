"""``offload_prompt_cache`` under copies that really defer: offload on and off give bitwise equal steps and samples.

On a CPU the host stager is an identity, so no ordering bug can show. Here every offloaded state stages
through :class:`~lightning_longctx.longstraw.offload.DeferredStreams` (``simulated_streams``): a copy lands in
its destination only when its event is waited on (or at a synchronize), and fresh buffers hold NaN, so a read
before its copy landed poisons the result. float32 models: "equal" means ``torch.equal``, not a tolerance.
:class:`UnorderedHostCopies` replays issue 22's race (the prefill's device-to-host copies left on the compute
stream, which the side stream's prefetches never wait for) and the same check catches it.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from lightning_longctx.longstraw import LossOptions, StepMemory, longstraw_step, sample
from lightning_longctx.longstraw.offload import DeferredStreams, HostStager, simulated_streams
from lightning_longctx.longstraw.step import prefill_for_step
from lightning_longctx.models.mla import StagedLatent
from lightning_longctx.ops import host_pages
from models_common import single_thread  # noqa: F401 - autouse fixture
from test_longstraw import make_group, tiny_model


class UnorderedHostCopies(DeferredStreams):
    """The pre-fix ordering: device-to-host copies queue apart (on the compute stream) and land only at a
    synchronize; waiting on a side-stream event does not wait for them."""

    def __init__(self) -> None:
        super().__init__()
        self._to_host: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(self, dst, src):
        if self.is_host(dst):
            self._to_host.append((dst, src))
            return self._landed + len(self._queue)
        return super().copy(dst, src)

    def synchronize(self) -> None:
        for dst, src in self._to_host:
            dst.copy_(src)
        self._to_host.clear()
        super().synchronize()


def float_model(chunk=1, seed=0, hybrid=False, latent=None):
    """The tiny GQA model, or (``hybrid``) linear, attention, attention layers, or (``latent``: ``"mla"`` /
    ``"dsa"``) the tiny MLA + MoE / GLM-5-shaped DSA model: float32."""
    if latent == "mla":
        from mla_workers import mla_config, mla_model

        return mla_model(mla_config(), seed=seed).float()
    if latent == "dsa":
        from dsa_workers import GLM, dsa_config, dsa_model

        return dsa_model(dsa_config(**GLM)).float()
    if hybrid:
        from longstraw_fused_workers import step_model

        return step_model("hybrid", chunk, seed=seed).float()
    return tiny_model(seed=seed, head_chunk_size=chunk).float()


def run_step(offload: bool, streams=None, *, prefilled: bool = False, **options):
    """Loss, log-probs and every parameter gradient of one exact step (a fresh model, same seed)."""
    model = float_model(options.pop("chunk", 1), hybrid=options.pop("hybrid", False),
                        latent=options.pop("latent", None))
    prompt, responses, advantages = make_group(3, prompt_len=options.pop("prompt_len", 23))
    memory = StepMemory(offload_prompt_cache=offload, measure_memory=False, **options)
    with simulated_streams(streams):
        state = None
        if prefilled:  # the prompt state made ahead (as sample / score share it), then the step
            state = prefill_for_step(model, prompt, loss=LossOptions(prompt_grad="full"), memory=memory)
        out = longstraw_step(model, prompt, responses, advantages.float(), prompt_state=state, memory=memory)
    return out.loss, out.logprobs, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_bitwise_equal(a, b) -> None:
    loss_a, logp_a, grads_a = a
    loss_b, logp_b, grads_b = b
    assert loss_a == loss_b
    assert all(torch.equal(x, y) for x, y in zip(logp_a, logp_b))
    differ = [n for n in grads_a if not torch.equal(grads_a[n], grads_b[n])]
    assert not differ, f"gradients differ: {differ}"


def test_deferred_copies_land_only_when_waited_on():
    streams = DeferredStreams()
    stager = HostStager("cpu", streams)
    t = torch.arange(6.0)
    host = stager.to_host(t)
    assert torch.isnan(host.to("cpu")).all()  # in flight (host pages, read as they are now)
    stager.prefetch("k", [host])
    copy, = stager._inflight["k"][0]
    assert torch.isnan(copy).all()
    fetched, = stager.fetch("k", [host])  # waits for its event: the host copy first (FIFO), then the prefetch
    assert fetched is copy and torch.equal(fetched, t) and torch.equal(host.to("cpu"), t)


@pytest.mark.parametrize("options", [
    dict(chunk=1), dict(chunk=None, replay_checkpointing=True), dict(chunk=1, keep_attention_output="host"),
    dict(chunk=1, prefilled=True), dict(chunk=1, hybrid=True, offload_checkpoints=True),
    dict(latent="mla"), dict(latent="mla", replay_checkpointing=True), dict(latent="dsa"),
])
def test_offload_on_and_off_give_bitwise_equal_steps(options):
    assert_bitwise_equal(run_step(False, **options), run_step(True, **options))


@pytest.mark.parametrize("options", [
    dict(chunk=1, keep_attention_output="host"),
    dict(chunk=1, hybrid=True, offload_checkpoints=True, prompt_len=150, state_segment=64, prompt_checkpoint_every=2),
    dict(latent="dsa", prompt_len=40),
])
def test_offload_over_many_small_pages_gives_bitwise_the_same_step(monkeypatch, options):
    """256-byte host pages: every host copy (K/V, their sums, kept attention outputs, checkpoints, the linear
    layers' segment states; an MLA latent, its sums, DSA index keys) spans many pages and a partial last one,
    each copied on its own and landing late; the step is still bitwise the one without offload."""
    monkeypatch.setattr(host_pages, "PAGE_BYTES", 256)
    made = []
    real = host_pages.PagedHostTensor.empty
    monkeypatch.setattr(host_pages.PagedHostTensor, "empty",
                        classmethod(lambda cls, *a, **k: made.append(real(*a, **k)) or made[-1]))
    assert_bitwise_equal(run_step(False, **options), run_step(True, **options))
    assert max(len(h.pages) for h in made) > 4


def test_a_device_tensor_goes_to_the_host_once_straight_into_pinned_pages(monkeypatch):
    """``offload.to_host`` of a (fake) CUDA tensor: one non-blocking device-to-host copy per page, its bytes
    once, no host sync, into pinned pages (it was a pageable copy then ``pin_memory()``: twice the host bytes,
    a synchronous copy; ``pin_memory`` has no fake kernel, so that raised here). (The way back, a copy into a
    view of a fake CUDA tensor, does not run on a CPU-only build: it is checked on CPU tensors.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_longctx.longstraw.offload import to_host
    from lightning_longctx.ops.step_phase import phase
    from lightning_longctx.ops.transfers import TransferCounter

    monkeypatch.setattr(host_pages, "PAGE_BYTES", 1024)
    with FakeTensorMode(), TransferCounter() as counter, phase("offload"):
        x = torch.empty(3, 1000, device="cuda")  # 12,000 bytes: 11 pages and a 1,024-byte rest block
        host = to_host(x)
    c = counter.phases["offload"]
    assert isinstance(host, host_pages.PagedHostTensor) and [p.numel() for p in host.pages] == [1024] * 12
    assert (c.d2h_bytes, c.d2h_copies, c.h2d_copies, c.syncs) == (12_000, 12, 0, 0)


def test_the_unordered_host_copies_of_issue_22_are_caught():
    loss, _, grads = run_step(True, UnorderedHostCopies())
    assert any(not torch.isfinite(g).all() for g in grads.values()) or loss != run_step(False)[0]


@pytest.mark.parametrize("latent", ["mla", "dsa"])
def test_an_offloaded_latent_state_lives_on_the_host_and_the_device_holds_two_layers_of_it(monkeypatch, latent):
    """The prefill puts every layer's latent (and DSA index keys) in host pages; through the replays and the
    grouped backward at most two layers' latents (a replay's forward or backward reading one, the next in
    flight) and two layers' gradient sums are alive on the "device" at once (3-layer models: a replay keeping
    each layer's fetched latent for its backward would hold three), and nothing is left in flight after the
    step."""
    model = float_model(latent=latent)
    prompt, responses, advantages = make_group(3, prompt_len=23)
    memory = StepMemory(offload_prompt_cache=True)
    refs, most = {"latent": [], "grad": []}, {"latent": 0, "grad": 0}

    def seen(kind, tensor):
        refs[kind].append(weakref.ref(tensor))
        most[kind] = max(most[kind], sum(r() is not None for r in refs[kind]))
        return tensor

    real_latent = StagedLatent.latent
    monkeypatch.setattr(StagedLatent, "latent", lambda self: seen("latent", real_latent(self)))
    with simulated_streams() as streams:
        state = prefill_for_step(model, prompt, loss=LossOptions(prompt_grad="full"), memory=memory)
        assert all(isinstance(t, host_pages.PagedHostTensor) for cache in state.caches for t in cache
                   if t is not None)
        real_fetch = state.stager.fetch
        state.stager.fetch = lambda key, tensors: [seen(key[0], t) if key[0] == "grad" else t
                                                   for t in real_fetch(key, tensors)]
        longstraw_step(model, prompt, responses, advantages, memory=memory, prompt_state=state)
        assert not state.stager._inflight and streams._landed > 0
    assert 1 <= most["latent"] <= 2 and 1 <= most["grad"] <= 2, most


@pytest.mark.parametrize("prompt_cache", ["device", "stream"])
@pytest.mark.parametrize("temperature,latent", [(0.0, None), (1.0, None), (1.0, "mla"), (1.0, "dsa")])
def test_offloaded_sampling_equals_the_device_cache(prompt_cache, temperature, latent):
    def responses(offload):
        model = float_model(latent=latent)
        prompt, _, _ = make_group(1, prompt_len=23)
        with simulated_streams():
            state = prefill_for_step(model, prompt, loss=LossOptions(prompt_grad="full"),
                                     memory=StepMemory(offload_prompt_cache=offload))
            return sample(model, prompt, 3, max_new_tokens=6, temperature=temperature, prompt_state=state,
                          generator=torch.Generator().manual_seed(5), prompt_cache=prompt_cache)

    assert all(torch.equal(a, b) for a, b in zip(responses(False), responses(True)))


def test_a_bad_prompt_cache_mode_is_refused():
    model = float_model()
    prompt, _, _ = make_group(1, prompt_len=9)
    with pytest.raises(ValueError, match="prompt_cache='host'"):
        sample(model, prompt, 2, max_new_tokens=2, prompt_cache="host")
