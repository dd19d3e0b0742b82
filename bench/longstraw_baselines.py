"""What the LongStraw step is measured against (``bench/longstraw_fused.py`` sections ``floor``, ``shared``, ``naive``).

- :func:`prompt_floor`: the prompt's own pass as plain code, no-grad and with autograd forward + backward: the
  embedding, every layer but the last, and the last layer's K/V only (``prompt_state``: nothing reads its
  outputs at prompt positions, so neither LongStraw step attends there; no logits, the prompt carries no loss).
  The detached step runs the first and the replays; the exact step must also back-propagate through it once,
  so its time is at least ``detached + (forward+backward - forward)``: the floor of ``exact / detached``.
- :func:`shared_prefix_step`: plain full autograd over ``[prompt; r_1; ...; r_G]`` with a prefix-sharing mask
  (every response attends to the whole prompt and causally to itself, never to another response), checkpointed
  per layer (``torch.utils.checkpoint``: each layer keeps its input, its backward recomputes it). One layer's
  forward is the prompt's causal attention plus each response over the prompt's differentiable K/V, which is
  exactly that mask: the same loss and gradients as the exact LongStraw step, by plain autograd.
- :func:`naive_step` (``bench/longstraw.py``'s): the G sequences ``cat(P, r_i)`` as one batch, plain autograd.

All on the model's own layers (``DecoderLM``: fused head-chunked attention, tiled MLP as configured), float32.
"""

from __future__ import annotations

import time

import torch
from torch.utils.checkpoint import checkpoint

from lightning_longctx.longstraw import policy_token_terms, response_weights
from lightning_longctx.ops import chunked_token_logprobs, track_memory


def _layers(model, hidden, pos):
    for layer in model.layers:
        hidden = layer(hidden, pos)
    return hidden


def _prompt_pass(model, ids, pos):
    hidden = model.embed(ids)
    for layer in model.layers[:-1]:
        hidden = layer(hidden, pos)
    return model.layers[-1].prompt_state(hidden, pos)


def prompt_floor(model, prompt: torch.Tensor, repeats: int = 1) -> dict:
    """Seconds (best of ``repeats``) of the prompt's pass (see the module doc) no-grad, and with autograd forward
    + backward (from gradients of the last layer's K/V)."""
    ids, pos = prompt.view(1, -1), torch.arange(prompt.numel(), device=prompt.device).view(1, -1)

    def forward():
        with torch.no_grad():
            _prompt_pass(model, ids, pos)

    def forward_backward():
        model.zero_grad(set_to_none=True)
        state = _prompt_pass(model, ids, pos)
        torch.autograd.backward(list(state), [torch.ones_like(t) for t in state])  # values do not matter here

    out = {}
    for name, fn in (("forward_s", forward), ("forward_backward_s", forward_backward)):
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        out[name] = best
    model.zero_grad(set_to_none=True)
    return out


def _loss(model, hidden_last, branch_hidden, response, advantage, weight):
    """The step's policy loss of one response from the hidden states predicting it: the prompt's last position
    (``r[0]``) and the response's own positions but its last (``r[1:]``)."""
    h = model.final_hidden(torch.cat([hidden_last, branch_hidden], dim=1))[0]
    logp = chunked_token_logprobs(h, model.output_weight, response, chunk_size=model.memory.logits_chunk_size)
    return weight * policy_token_terms(logp, advantage).loss.sum()


def shared_prefix_step(model, prompt, responses, advantages, checkpoint_layers: bool = True) -> float:
    """One forward + backward of plain autograd over ``[prompt; r_1..r_G]`` with the prefix-sharing mask, each
    layer checkpointed (see the module doc); loss ``token_mean`` as the step's. Returns the loss."""
    s = prompt.numel()
    pos_p = torch.arange(s, device=prompt.device).view(1, -1)
    branch_ids = [r[:-1].view(1, -1) for r in responses]
    branch_pos = [s + torch.arange(r.numel() - 1, device=prompt.device).view(1, -1) for r in responses]

    def layer_fn(layer, h_prompt, *h_branches):
        out, kv = layer(h_prompt, pos_p, return_state=True)  # differentiable K/V: the responses' gradient flows
        return (out, *(layer(h, p, prefix_state=kv) for h, p in zip(h_branches, branch_pos)))

    hidden = (model.embed(prompt.view(1, -1)), *(model.embed(ids) for ids in branch_ids))
    for layer in model.layers:
        if checkpoint_layers:
            hidden = checkpoint(layer_fn, layer, *hidden, use_reentrant=False)
        else:
            hidden = layer_fn(layer, *hidden)
    weights = response_weights([r.numel() for r in responses], "token_mean")
    last = hidden[0][:, -1:]
    loss = sum(_loss(model, last, h, r, a, w) for h, r, a, w in zip(hidden[1:], responses, advantages, weights))
    loss.backward()
    return float(loss.detach())


def naive_step(model, prompt, responses, advantages, logits_chunk_size):
    """Plain autograd over the G concatenated sequences as one batch (equal lengths: responses padded)."""
    s = prompt.numel()
    t_max = max(r.numel() for r in responses)
    ids = torch.stack([torch.cat([prompt, torch.nn.functional.pad(r, (0, t_max - r.numel()))]) for r in responses])
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    hidden = model.final_hidden(_layers(model, model.embed(ids), positions))
    weights = response_weights([r.numel() for r in responses], "token_mean")
    loss = 0.0
    for i, r in enumerate(responses):
        logp = chunked_token_logprobs(hidden[i, s - 1: s - 1 + r.numel()], model.output_weight, r,
                                      chunk_size=logits_chunk_size)
        loss = loss + weights[i] * policy_token_terms(logp, advantages[i]).loss.sum()
    loss.backward()
    return float(loss.detach())


def peak_and_seconds(fn, device) -> tuple[int, float]:
    """Peak live tensor bytes (the tracker) and wall seconds of ``fn()``."""
    with track_memory(device) as mem:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return mem.peak_bytes, seconds


__all__ = ["naive_step", "peak_and_seconds", "prompt_floor", "shared_prefix_step"]
