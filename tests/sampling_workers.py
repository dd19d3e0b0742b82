"""Models, independent references and the multi-process worker of ``test_sampling.py``.

The references never touch ``lightning_longctx.longstraw``: the next-token distribution of a context is the
model's ordinary ``forward`` over the whole sequence ``cat(prompt, tokens so far)`` (one process), and the
top-k / top-p restriction is recomputed here with plain Python loops over the sorted probabilities.
"""

from __future__ import annotations

import torch

from lightning_longctx.longstraw.sampling import sample
from lightning_longctx.models import MemoryConfig
from models_common import tiny_config, tiny_model

VOCAB = 61
HYBRID_LAYERS = ["linear_attention", "full_attention", "linear_attention"]
KINDS = ("plain", "hybrid", "lora")


def build_model(kind: str, head_chunk_size: int | None = None):
    """``plain``: Qwen3-shaped GQA (8 query heads over 2 K/V heads, qk-norm, q/k/v/o biases, tied embeddings);
    ``hybrid``: Qwen3.5-shaped (Gated DeltaNet, gated attention with partial RoPE, Gated DeltaNet);
    ``lora``: the hybrid with random LoRA adapters on every attention and MLP projection. float64."""
    memory = MemoryConfig(head_chunk_size=head_chunk_size)
    if kind == "plain":
        return tiny_model(tiny_config("qwen3", vocab_size=VOCAB, num_key_value_heads=2), memory)
    config = tiny_config("hybrid", vocab_size=VOCAB, num_hidden_layers=3, layer_types=HYBRID_LAYERS)
    model = tiny_model(config, memory)
    if kind == "lora":
        model.add_lora(r=2, alpha=4.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"])
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():  # B starts at zero: make the adapters change every projection
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def make_prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def next_logits(model, context: torch.Tensor) -> torch.Tensor:
    """Last-position logits ``[vocab]`` of the plain full forward over ``context [n]`` (one process)."""
    return model(context[None]).logits[0, -1]


@torch.no_grad()
def greedy_reference(model, prompt: torch.Tensor, steps: int) -> list[int]:
    seq = prompt.clone()
    for _ in range(steps):
        seq = torch.cat([seq, next_logits(model, seq).argmax().view(1)])
    return seq[prompt.numel():].tolist()


def restriction_reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(logits / T) restricted to the top_k most probable tokens, renormalised, then to the smallest
    most-probable set with mass >= top_p, renormalised; written as loops over Python floats."""
    probs = torch.softmax(logits.double() / temperature, dim=0).tolist()
    order = sorted(range(len(probs)), key=lambda v: -probs[v])
    kept = order[:top_k] if top_k else order
    mass = sum(probs[v] for v in kept)
    weights = {v: probs[v] / mass for v in kept}
    if top_p < 1:
        chosen, before = {}, 0.0
        for v in kept:
            if before >= top_p:
                break
            chosen[v] = weights[v]
            before += weights[v]
        total = sum(chosen.values())
        weights = {v: w / total for v, w in chosen.items()}
    out = torch.zeros(len(probs), dtype=torch.float64)
    for v, w in weights.items():
        out[v] = w
    return out


def check_step_probs(model, prompt, responses, records, temperature, top_k, top_p, atol=1e-10) -> int:
    """Each recorded ``(step, rows, probs)`` equals the reference restriction of the full-forward logits of
    each row's context ``cat(prompt, response[:step])``, and each drawn token lies in it. Returns how many
    of the reference distributions the restriction actually narrowed (fewer tokens than the vocabulary)."""
    narrowed = 0
    for step, rows, probs in records:
        rows, probs = torch.as_tensor(rows), torch.as_tensor(probs, dtype=torch.float64)
        for row, got in zip(rows.tolist(), probs):
            want = restriction_reference(next_logits(model, torch.cat([prompt, responses[row][:step]])),
                                         temperature, top_k, top_p)
            torch.testing.assert_close(got.double(), want, atol=atol, rtol=0,
                                       msg=lambda m, step=step, row=row: f"step {step} response {row}: {m}")
            assert want[responses[row][step]] > 0, f"step {step} response {row} drew a token outside the set"
            narrowed += int((want > 0).sum()) < want.numel()
    return narrowed


SP_CASES = [  # (kind, head_chunk_size, prompt length): (S - 1) % P != 0 for P = 2 and 4, so a tail of 2..4
    ("plain", None, 24), ("plain", 1, 22), ("hybrid", None, 22), ("lora", 1, 24),
]
SP_GREEDY_GROUPS = (1, 3, 8)
SP_STEPS = 5
SP_SAMPLED = dict(num_responses=4, max_new_tokens=4, temperature=0.9, top_k=12, top_p=0.8)


def sp_worker(rank, world):
    """Every case on ``world`` gloo SP ranks: greedy token lists per (case, G), and one sampled group with
    its recorded step distributions (the test compares them with the single-process references)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = {}
    for case, (kind, chunk, length) in enumerate(SP_CASES):
        model, prompt = build_model(kind, chunk), make_prompt(length, seed=case)
        for g in SP_GREEDY_GROUPS:
            got = sample(model, prompt, g, max_new_tokens=SP_STEPS, temperature=0.0, group=dist.group.WORLD)
            out[(case, g)] = [r.tolist() for r in got]
        records = []
        gen = torch.Generator().manual_seed(100 + case)
        got = sample(model, prompt, **SP_SAMPLED, group=dist.group.WORLD, generator=gen,
                     on_step=lambda step, rows, probs, seen=records: seen.append((step, rows.tolist(), probs.tolist())))
        # plain lists: tensors would travel back through shared memory that dies with the worker
        out[(case, "sampled")] = ([r.tolist() for r in got], records)
    return out
