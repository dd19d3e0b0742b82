"""One input-validation sweep over the public entry points: each bad input is one parametrized case.

Strategy: every case calls an entry point with one bad argument and asserts a ``ValueError`` / ``TypeError`` (a
missing file: ``FileNotFoundError``; the CLI: ``ConfigError``, or Hydra's composition error) whose message
contains the offending value, raised before any work: where a model is involved, a forward pre-hook on every
submodule counts calls (none may run) and every parameter and gradient is compared bitwise with a snapshot taken
before the call. The CLI cases run in-process (Hydra compose + ``run_train`` / ``format_plan``) with the Trainer,
the process group and the model builder replaced by functions that fail the test; every ``longctx-train`` case
is a ``ConfigError`` (the console prints its message alone, as two subprocess cases check). The checks that
depend on the sequence-parallel size run in one 2-process gloo run. Single cases tested elsewhere
(``test_longstraw``, ``test_config``, ``test_cli``, ``test_models_*``) are repeated only where a category needs
them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from safetensors.torch import load_file, save_file

from distributed import run_distributed
from lightning_longctx.longstraw import longstraw_step, sample, score
from lightning_longctx.models import DecoderConfig, DecoderLM, MemoryConfig
from lightning_longctx.parallel import shard_batch, ulysses_attention
from test_longstraw import with_options

VOCAB = 64
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)  # conf/model/tiny.yaml
NAN, INF = float("nan"), float("inf")


def refused(call, exc, *fragments, model=None) -> None:
    """``call()`` raises ``exc`` naming every fragment, before any submodule of ``model`` runs, leaving its
    parameters and gradients bitwise unchanged."""
    calls = []
    hooks, before = [], {}
    if model is not None:
        hooks = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for m in model.modules() if m is not model]
        before = {n: (p.detach().clone(), None if p.grad is None else p.grad.clone())
                  for n, p in model.named_parameters()}
    try:
        with pytest.raises(exc) as err:
            call()
    finally:
        for hook in hooks:
            hook.remove()
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    assert not calls, f"{len(calls)} submodule forwards ran before the error"
    for name, p in (model.named_parameters() if model is not None else ()):
        value, grad = before[name]
        assert torch.equal(p.detach(), value), f"{name} changed"
        assert (p.grad is None and grad is None) or torch.equal(p.grad, grad), f"{name}.grad changed"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(**TINY))


# --------------------------------------------------------------------------------------------- ulysses_attention
Q, KV = (1, 8, 4, 16), (1, 8, 2, 16)
ULYSSES = [
    ("q-3d", dict(query=torch.randn(8, 4, 16)), ValueError, ["(8, 4, 16)"]),
    ("q-list", dict(query=[1.0]), TypeError, ["query", "list"]),
    ("int-dtype", dict(query=torch.ones(Q, dtype=torch.long), key=torch.ones(KV, dtype=torch.long),
                       value=torch.ones(KV, dtype=torch.long)), ValueError, ["torch.int64"]),
    ("dtype-mismatch", dict(key=torch.randn(KV, dtype=torch.float64)), ValueError, ["torch.float64"]),
    ("kv-shape-mismatch", dict(value=torch.randn(1, 4, 2, 16)), ValueError, ["(1, 4, 2, 16)"]),
    ("batch-mismatch", dict(key=torch.randn(2, 8, 2, 16), value=torch.randn(2, 8, 2, 16)), ValueError,
     ["(2, 8, 2, 16)"]),
    ("head-dim-mismatch", dict(key=torch.randn(1, 8, 2, 8), value=torch.randn(1, 8, 2, 8)), ValueError,
     ["(1, 8, 2, 8)"]),
    ("heads-not-multiple-of-kv", dict(query=torch.randn(1, 8, 3, 16)), ValueError, ["num_attention_heads=3"]),
    ("device-mismatch", dict(key=torch.randn(KV, device="meta"), value=torch.randn(KV, device="meta")), ValueError,
     ["meta"]),
    ("chunk-0", dict(head_chunk_size=0), ValueError, ["head_chunk_size=0"]),
    ("chunk-3", dict(head_chunk_size=3), ValueError, ["head_chunk_size=3"]),
    ("chunk-float", dict(head_chunk_size=1.5), TypeError, ["head_chunk_size=1.5"]),
    ("causal-str", dict(causal="yes"), TypeError, ["causal='yes'"]),
    ("scale-negative", dict(softmax_scale=-1.0), ValueError, ["softmax_scale=-1.0"]),
    ("scale-str", dict(softmax_scale="x"), ValueError, ["softmax_scale='x'"]),
    ("group-str", dict(group="world"), TypeError, ["group", "str"]),
    ("backend", dict(backend="bogus"), ValueError, ["'bogus'"]),
]


@pytest.mark.parametrize("change, exc, fragments", [c[1:] for c in ULYSSES], ids=[c[0] for c in ULYSSES])
def test_ulysses_attention_refuses(change, exc, fragments):
    args = dict(query=torch.randn(Q), key=torch.randn(KV), value=torch.randn(KV)) | change
    refused(lambda: ulysses_attention(args.pop("query"), args.pop("key"), args.pop("value"), **args), exc, *fragments)


SP_CASES = {  # name: (q heads, kv heads, head_chunk_size, fragments); on 2 ranks
    "heads-not-divisible-by-sp": (3, 1, None, ["num_attention_heads=3 must be divisible by sp_size=2"]),
    "kv-heads-vs-sp": (6, 3, None, ["num_key_value_heads=3 must divide or be divisible by sp_size=2"]),
    "chunk-vs-local-heads": (4, 2, 4, ["head_chunk_size=4", "4/2=2"]),
    "ranks-disagree-on-shape": (4, 2, None, ["rank 0: [1, 8, 4, 16]", "rank 1: [1, 6, 4, 16]"]),
}


def sp_refusals(rank, world):
    import torch.distributed as dist

    from lightning_longctx.parallel import check_group_shapes

    out = {}
    for name, (heads, kv_heads, chunk, _) in SP_CASES.items():
        seq = 8 if rank == 0 or name != "ranks-disagree-on-shape" else 6
        q, kv = torch.randn(1, seq, heads, 16), torch.randn(1, seq, kv_heads, 16)
        try:
            if name == "ranks-disagree-on-shape":
                check_group_shapes(q, dist.group.WORLD, "query")
            ulysses_attention(q, kv, kv, group=dist.group.WORLD, head_chunk_size=chunk)
            out[name] = ("no error", "")
        except Exception as err:  # noqa: BLE001 - reported to the parent
            out[name] = (type(err).__name__, str(err))
    return out


@pytest.fixture(scope="module")
def sp_results():
    return run_distributed(sp_refusals, 2, timeout=120)


@pytest.mark.parametrize("name", list(SP_CASES))
def test_ulysses_attention_refuses_on_two_ranks(sp_results, name):
    for rank, results in enumerate(sp_results):
        kind, message = results[name]
        assert kind == "ValueError", (rank, kind, message)
        for fragment in SP_CASES[name][3]:
            assert fragment in message, (rank, message)


# --------------------------------------------------------------------------------------------- shard_batch
IDS = torch.randint(0, 10, (2, 7))
SHARD = [
    ("ids-1d", dict(input_ids=IDS[0]), ValueError, ["(7,)"]),
    ("ids-list", dict(input_ids=[[1, 2]]), TypeError, ["input_ids", "list"]),
    ("ids-float", dict(input_ids=IDS.float()), ValueError, ["torch.float32"]),
    ("labels-shape", dict(labels=IDS[:, :5]), ValueError, ["(2, 5)"]),
    ("attention-mask-shape", dict(attention_mask=torch.ones(2, 5)), ValueError, ["attention_mask (2, 5)"]),
    ("loss-mask-shape", dict(loss_mask=torch.ones(3, 7)), ValueError, ["loss_mask (3, 7)"]),
    ("rank-out-of-range", dict(sp_rank=2), ValueError, ["sp_rank=2", "sp_size=2"]),
    ("rank-negative", dict(sp_rank=-1), ValueError, ["sp_rank=-1"]),
    ("sp-size-0", dict(sp_size=0, sp_rank=0), ValueError, ["sp_size=0"]),
    ("sp-size-float", dict(sp_size=1.5), TypeError, ["sp_size=1.5"]),
]


@pytest.mark.parametrize("change, exc, fragments", [c[1:] for c in SHARD], ids=[c[0] for c in SHARD])
def test_shard_batch_refuses(change, exc, fragments):
    args = dict(input_ids=IDS, sp_rank=0, sp_size=2) | change
    refused(lambda: shard_batch(args.pop("input_ids"), **args), exc, *fragments)


# --------------------------------------------------------------------------------------------- DecoderLM
CONFIGS = [  # DecoderConfig / MemoryConfig / DecoderLM arguments (test_models_config pins the shape rules)
    ("vocab-0", dict(vocab_size=0), ValueError, ["vocab_size=0"]),
    ("hidden-str", dict(hidden_size="64"), ValueError, ["hidden_size='64'"]),
    ("heads-vs-kv", dict(num_key_value_heads=3), ValueError, ["num_key_value_heads=3"]),
    ("rope-theta-str", dict(rope_theta="x"), TypeError, ["rope_theta='x'"]),
    ("rope-theta-nan", dict(rope_theta=NAN), ValueError, ["rope_theta=nan"]),
    ("rope-parameters-str", dict(rope_parameters="llama3"), TypeError, ["rope_parameters='llama3'"]),
    ("initializer-range-negative", dict(initializer_range=-1.0), ValueError, ["initializer_range=-1.0"]),
    ("flag-str", dict(tie_word_embeddings="yes"), TypeError, ["tie_word_embeddings='yes'"]),
    ("layer-type", dict(layer_types=["full_attention", "sliding"]), ValueError, ["layer_types[1]='sliding'"]),
    ("memory-chunk-fits-no-sp", dict(memory=MemoryConfig(head_chunk_size=3)), ValueError, ["head_chunk_size=3"]),
    ("memory-dict", dict(memory={"head_chunk_size": 1}), TypeError, ["MemoryConfig", "dict"]),
    ("config-dict", dict(config=TINY), TypeError, ["DecoderConfig", "dict"]),
]


@pytest.mark.parametrize("change, exc, fragments", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_decoder_construction_refuses(change, exc, fragments):
    change = dict(change)
    memory, config = change.pop("memory", None), change.pop("config", None)
    refused(lambda: DecoderLM(config if config is not None else DecoderConfig(**TINY | change), memory),
            exc, *fragments)


FORWARD = [
    ("ids-1d", dict(input_ids=torch.randint(0, VOCAB, (7,))), ["(7,)"]),
    ("ids-float", dict(input_ids=torch.rand(1, 7)), ["integer"]),
    ("positions-shape", dict(position_ids=torch.arange(5)[None]), ["position_ids (1, 5)"]),
    ("labels-and-shift-labels", dict(labels=torch.zeros(1, 7, dtype=torch.long),
                                     shift_labels=torch.zeros(1, 7, dtype=torch.long)), ["not both"]),
]


@pytest.mark.parametrize("change, fragments", [c[1:] for c in FORWARD], ids=[c[0] for c in FORWARD])
def test_decoder_forward_refuses(model, change, fragments):
    args = dict(input_ids=torch.randint(0, VOCAB, (1, 7))) | change
    refused(lambda: model(**args), ValueError, *fragments, model=model)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model):
    path = tmp_path_factory.mktemp("ckpt") / "good"
    model.save_pretrained(path)
    return path


def _config(edit):
    def apply(path):
        cfg = json.loads((path / "config.json").read_text())
        edit(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    return apply


def _weights(edit):
    def apply(path):
        tensors = load_file(str(path / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(path / "model.safetensors"))
    return apply


def _sharded_index(path):
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))


CHECKPOINTS = [  # (id, how the good checkpoint is broken, exception, fragments of the message)
    ("missing-dir", lambda p: shutil.rmtree(p), FileNotFoundError, ["no config.json"]),
    ("no-config", lambda p: (p / "config.json").unlink(), FileNotFoundError, ["no config.json"]),
    ("config-not-json", lambda p: (p / "config.json").write_text("{oops"), ValueError, ["config.json is not valid"]),
    ("config-a-list", lambda p: (p / "config.json").write_text("[1]"), ValueError, ["got a list"]),
    ("unknown-model-type", _config(lambda c: c.update(model_type="gpt2")), ValueError, ["model_type='gpt2'"]),
    ("no-model-type", _config(lambda c: c.pop("model_type")), ValueError, ["model_type=None"]),
    ("missing-field", _config(lambda c: c.pop("hidden_size")), ValueError, ["'hidden_size'", "config.json"]),
    ("bad-field", _config(lambda c: c.update(num_attention_heads=3)), ValueError, ["num_attention_heads=3"]),
    ("unsupported-field", _config(lambda c: c.update(hidden_act="gelu")), ValueError, ["hidden_act='gelu'"]),
    ("missing-weight", _weights(lambda t: t.pop("model.norm.weight")), ValueError, ["missing ['model.norm.weight']"]),
    ("extra-weight", _weights(lambda t: t.update({"model.extra": torch.zeros(2)})), ValueError,
     ["unexpected ['model.extra']"]),
    ("mis-shaped-weight", _weights(lambda t: t.update({"model.norm.weight": torch.zeros(3)})), ValueError,
     ["model.norm.weight: checkpoint (3,) vs model (64,)"]),
    ("corrupt-safetensors", lambda p: (p / "model.safetensors").write_bytes(b"\x00garbage" * 10), ValueError,
     ["model.safetensors is not a readable safetensors file"]),
    ("truncated-safetensors", lambda p: (p / "model.safetensors").write_bytes(
        (p / "model.safetensors").read_bytes()[:1000]), ValueError, ["model.safetensors is not a readable"]),
    ("no-weights", lambda p: (p / "model.safetensors").unlink(), FileNotFoundError, ["neither model.safetensors"]),
    ("index-without-weight-map", lambda p: ((p / "model.safetensors").unlink(),
                                            (p / "model.safetensors.index.json").write_text("{}")), ValueError,
     ["no 'weight_map'"]),
    ("index-names-missing-shard", _sharded_index, FileNotFoundError, ["model-00002-of-00002.safetensors"]),
]


@pytest.mark.parametrize("breaks, exc, fragments", [c[1:] for c in CHECKPOINTS], ids=[c[0] for c in CHECKPOINTS])
def test_from_pretrained_refuses_a_broken_checkpoint(tmp_path, checkpoint, breaks, exc, fragments):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    breaks(path)
    refused(lambda: DecoderLM.from_pretrained(path), exc, *fragments)


@pytest.mark.parametrize("kwargs, exc, fragment", [(dict(dtype="float32"), TypeError, "dtype='float32'"),
                                                   (dict(memory={"x": 1}), TypeError, "MemoryConfig")],
                         ids=["dtype-str", "memory-dict"])
def test_from_pretrained_refuses_bad_arguments(checkpoint, kwargs, exc, fragment):
    refused(lambda: DecoderLM.from_pretrained(checkpoint, **kwargs), exc, fragment)


# --------------------------------------------------------------------------------------------- LongStraw
PROMPT = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(1))
RESPONSES = [torch.tensor([3, 4, 5]), torch.tensor([6, 7, 8, 9, 10])]
STEP = [  # test_longstraw pins the group checks (lengths, vocabulary, loss_type, log-prob shapes)
    ("model-none", dict(model=None), TypeError, ["NoneType"]),
    ("prompt-list", dict(prompt_ids=[1, 2]), TypeError, ["prompt_ids", "list"]),
    ("prompt-2d", dict(prompt_ids=PROMPT[None]), ValueError, ["(1, 9)"]),
    ("prompt-float", dict(prompt_ids=PROMPT.float()), ValueError, ["prompt_ids", "torch.float32"]),
    ("prompt-out-of-vocab", dict(prompt_ids=torch.tensor([1, VOCAB])), ValueError, [f"[1, {VOCAB}]"]),
    ("responses-empty", dict(responses=[]), ValueError, ["responses is empty"]),
    ("response-float", dict(responses=[RESPONSES[0].float(), RESPONSES[1]]), ValueError, ["response 0"]),
    ("advantages-list", dict(advantages=[1.0, -1.0]), TypeError, ["advantages", "list"]),
    ("advantages-2d", dict(advantages=torch.ones(1, 2)), ValueError, ["(1, 2)"]),
    ("advantages-nan", dict(advantages=torch.tensor([1.0, NAN])), ValueError, ["nan"]),
    ("loss-type", dict(loss=dict(loss_type="sum")), ValueError, ["'sum'"]),
    ("prompt-grad", dict(loss=dict(prompt_grad="half")), ValueError, ["'half'"]),
    ("beta-negative", dict(loss=dict(beta=-1.0)), ValueError, ["beta=-1.0"]),
    ("beta-nan", dict(loss=dict(beta=NAN)), ValueError, ["beta=nan"]),
    ("clip-eps-negative", dict(loss=dict(clip_eps=(-0.1, 0.2))), ValueError, ["clip_eps=(-0.1, 0.2)"]),
    ("clip-eps-float", dict(loss=dict(clip_eps=0.2)), ValueError, ["clip_eps=0.2"]),
    ("temperature-0", dict(loss=dict(temperature=0)), ValueError, ["temperature=0"]),
    ("temperature-bool", dict(loss=dict(temperature=True)), ValueError, ["temperature=True"]),
    ("logits-chunk-0", dict(memory=dict(logits_chunk_size=0)), ValueError, ["logits_chunk_size=0"]),
    ("state-segment", dict(memory=dict(state_segment=63)), ValueError, ["state_segment=63"]),
    ("keep-attention-output", dict(memory=dict(keep_attention_output="gpu")), ValueError, ["'gpu'"]),
    ("accumulate-dtype-int", dict(groups=dict(accumulate_dtype=torch.int32)), TypeError, ["torch.int32"]),
    ("accumulate-dtype-str", dict(groups=dict(accumulate_dtype="float32")), TypeError, ["'float32'"]),
    ("group-str", dict(groups=dict(sp_group="world")), TypeError, ["group", "str"]),
    ("dp-group-str", dict(groups=dict(dp_group="dp")), TypeError, ["dp_group", "str"]),
    ("prompt-state-str", dict(prompt_state="x"), TypeError, ["prompt_state", "str"]),
    ("replay-checkpointing-str", dict(memory=dict(replay_checkpointing="yes")), TypeError,
     ["replay_checkpointing='yes'"]),
    ("old-logprobs-count", dict(old_logprobs=[torch.zeros(3)]), ValueError, ["old_logprobs has 1 entries"]),
    ("max-response-length", dict(loss=dict(loss_type="seq_mean_token_sum_norm", max_response_length=2)), ValueError,
     ["max_response_length=2"]),
]


@pytest.mark.parametrize("change, exc, fragments", [c[1:] for c in STEP], ids=[c[0] for c in STEP])
def test_longstraw_step_refuses(model, change, exc, fragments):
    args = dict(model=model, prompt_ids=PROMPT, responses=RESPONSES, advantages=torch.tensor([1.0, -1.0])) | change
    refused(lambda: longstraw_step(**with_options(args)), exc, *fragments, model=model)


def ranks_disagree_refusals(rank, world):
    """``longstraw_step`` and ``sample`` with a group that differs on rank 1: (error kind, message, forwards run
    before it) per call."""
    import torch.distributed as dist

    from lightning_longctx.longstraw import StepGroups

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(**TINY))
    calls = []
    for module in model.modules():
        if module is not model:
            module.register_forward_pre_hook(lambda *_: calls.append(1))
    longer = RESPONSES[1] if rank == 0 else torch.cat([RESPONSES[1], RESPONSES[1][:1]])
    attempts = {
        "step": lambda: longstraw_step(model, PROMPT, [RESPONSES[0], longer], torch.tensor([1.0, -1.0]),
                                       groups=StepGroups(sp_group=dist.group.WORLD)),
        "sample": lambda: sample(model, PROMPT, 2, max_new_tokens=3 + rank, group=dist.group.WORLD),
    }
    out = {}
    for name, attempt in attempts.items():
        calls.clear()
        try:
            attempt()
            out[name] = ("no error", "", len(calls))
        except Exception as err:  # noqa: BLE001 - reported to the parent
            out[name] = (type(err).__name__, str(err), len(calls))
    return out


def test_ranks_that_disagree_on_the_group_are_refused_naming_each_rank():
    """One all-gather of the group's sizes before any work: a rank with another response (or another
    ``max_new_tokens``) would otherwise hang or corrupt the all-to-alls."""
    expected = {"step": ["disagree on the group", "rank 0: prompt=9 G=2 response tokens=8 longest=5",
                         "rank 1: prompt=9 G=2 response tokens=9 longest=6"],
                "sample": ["disagree on the sampling call", "rank 0: prompt=9 G=2 max_new_tokens=3",
                           "rank 1: prompt=9 G=2 max_new_tokens=4"]}
    for rank, results in enumerate(run_distributed(ranks_disagree_refusals, 2, timeout=120)):
        for name, fragments in expected.items():
            kind, message, forwards = results[name]
            assert kind == "ValueError" and forwards == 0, (rank, name, kind, message, forwards)
            for fragment in fragments:
                assert fragment in message, (rank, name, message)


SCORE = [
    ("temperature-0", dict(temperature=0), ValueError, ["temperature=0"]),
    ("responses-empty", dict(responses=[]), ValueError, ["responses is empty"]),
    ("response-out-of-vocab", dict(responses=[torch.tensor([VOCAB])]), ValueError, [f"[{VOCAB}, {VOCAB}]"]),
    ("logits-chunk-0", dict(logits_chunk_size=0), ValueError, ["logits_chunk_size=0"]),
    ("prompt-float", dict(prompt_ids=PROMPT.float()), ValueError, ["torch.float32"]),
]


@pytest.mark.parametrize("change, exc, fragments", [c[1:] for c in SCORE], ids=[c[0] for c in SCORE])
def test_score_refuses(model, change, exc, fragments):
    args = dict(prompt_ids=PROMPT, responses=RESPONSES) | change
    refused(lambda: score(model, args.pop("prompt_ids"), args.pop("responses"), **args), exc, *fragments,
            model=model)


SAMPLE = [
    ("group-0", dict(num_responses=0), ValueError, ["num_responses=0"]),
    ("group-bool", dict(num_responses=True), ValueError, ["num_responses=True"]),
    ("group-float", dict(num_responses=2.0), ValueError, ["num_responses=2.0"]),
    ("max-new-tokens-0", dict(max_new_tokens=0), ValueError, ["max_new_tokens=0"]),
    ("temperature-negative", dict(temperature=-1.0), ValueError, ["temperature=-1.0"]),
    ("temperature-nan", dict(temperature=NAN), ValueError, ["temperature=nan"]),
    ("temperature-bool", dict(temperature=True), ValueError, ["temperature=True"]),
    ("top-p-0", dict(top_p=0.0), ValueError, ["top_p=0.0"]),
    ("top-p-above-1", dict(top_p=1.5), ValueError, ["top_p=1.5"]),
    ("top-p-bool", dict(top_p=True), ValueError, ["top_p=True"]),
    ("top-k-negative", dict(top_k=-1), ValueError, ["top_k=-1"]),
    ("top-k-float", dict(top_k=1.5), ValueError, ["top_k=1.5"]),
    ("eos-negative", dict(eos_token_id=-1), ValueError, ["eos_token_id=-1"]),
    ("eos-vocab", dict(eos_token_id=VOCAB), ValueError, [f"eos_token_id={VOCAB}"]),
    ("eos-bool", dict(eos_token_id=True), ValueError, ["eos_token_id=True"]),
    ("generator-int", dict(generator=1), TypeError, ["generator", "int"]),
    ("on-step-int", dict(on_step=3), TypeError, ["on_step", "int"]),
    ("prompt-2d", dict(prompt_ids=PROMPT[None]), ValueError, ["(1, 9)"]),
    ("prompt-float", dict(prompt_ids=PROMPT.float()), ValueError, ["torch.float32"]),
    ("prompt-out-of-vocab", dict(prompt_ids=torch.tensor([VOCAB + 6, 1])), ValueError, [f"[1, {VOCAB + 6}]"]),
]


@pytest.mark.parametrize("change, exc, fragments", [c[1:] for c in SAMPLE], ids=[c[0] for c in SAMPLE])
def test_sample_refuses(model, change, exc, fragments):
    args = dict(prompt_ids=PROMPT, num_responses=2, max_new_tokens=3) | change
    refused(lambda: sample(model, args.pop("prompt_ids"), args.pop("num_responses"), **args), exc, *fragments,
            model=model)


# --------------------------------------------------------------------------------------------- strategies
STRATEGY = [
    ("sp-size-0", dict(sp_size=0), ValueError, ["sp_size=0"]),
    ("sp-size-float", dict(sp_size=1.5), ValueError, ["sp_size=1.5"]),
    ("sp-size-bool", dict(sp_size=True), ValueError, ["sp_size=True"]),
    ("sp-size-str", dict(sp_size="2"), ValueError, ["sp_size='2'"]),
    ("head-chunk-0", dict(head_chunk_size=0), ValueError, ["head_chunk_size=0"]),
    ("sharding", dict(sharding="ddp"), ValueError, ["sharding='ddp'"]),
    ("backend", dict(process_group_backend="mpii"), ValueError, ["process_group_backend='mpii'"]),
    ("timeout-int", dict(timeout=5), ValueError, ["timeout=5"]),
    ("timeout-negative", dict(timeout=timedelta(seconds=-1)), ValueError, ["timeout="]),
    ("save-distributed-str", dict(save_distributed_checkpoint="yes"), TypeError, ["'yes'"]),
]


@pytest.mark.parametrize("kind", ["trainer", "fabric"])
@pytest.mark.parametrize("kwargs, exc, fragments", [c[1:] for c in STRATEGY], ids=[c[0] for c in STRATEGY])
def test_strategy_constructors_refuse(kind, kwargs, exc, fragments):
    from lightning_longctx import UlyssesFabricStrategy, UlyssesStrategy

    cls = UlyssesStrategy if kind == "trainer" else UlyssesFabricStrategy
    refused(lambda: cls(**kwargs), exc, *fragments)


@pytest.mark.parametrize("kind", ["trainer", "fabric"])
def test_sp_size_that_does_not_divide_the_devices_is_refused_before_any_process(kind):
    import lightning.pytorch as pl
    from lightning.fabric import Fabric

    from lightning_longctx import UlyssesFabricStrategy, UlyssesStrategy

    def build():
        if kind == "trainer":
            pl.Trainer(strategy=UlyssesStrategy(sp_size=3), accelerator="cpu", devices=2, logger=False)
        else:
            Fabric(strategy=UlyssesFabricStrategy(sp_size=3), accelerator="cpu", devices=2)

    refused(build, ValueError, "world size 2", "sp_size=3")


# --------------------------------------------------------------------------------------------- the CLI
def compose_cfg(*overrides: str, config_name: str = "config"):
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


@pytest.fixture
def no_work(monkeypatch):
    """The Trainer, the process group and the model builder fail the test if the CLI reaches them."""
    import lightning.pytorch as pl

    from lightning_longctx import cli

    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the bad input was refused")

    for target, name in ((pl, "Trainer"), (cli, "build_model"), (torch.distributed, "init_process_group")):
        monkeypatch.setattr(target, name, forbidden)
    return cli


MISSING = "/nonexistent/prompts.jsonl"
TRAIN = [  # overrides, fragments of the ConfigError / ValueError; test_config and test_cli pin more key checks
    ("sp-size-3", ["cluster.sp_size=3"], ["sp_size=3"]),
    ("devices-0", ["cluster.devices=0"], ["devices=0"]),
    ("sharding", ["cluster.sharding=ddp"], ["sharding='ddp'"]),
    ("accelerator", ["cluster.accelerator=tpuu"], ["cluster.accelerator='tpuu'"]),
    ("backend", ["cluster.process_group_backend=mpii"], ["cluster.process_group_backend='mpii'"]),
    ("collective-timeout", ["cluster.collective_timeout_s=-1"], ["cluster.collective_timeout_s=-1"]),
    ("head-chunk", ["memory.head_chunk_size=3"], ["head_chunk_size=3"]),
    ("precision", ["memory.precision=fp16"], ["'fp16'"]),
    ("model-heads", ["model.num_attention_heads=3"], ["model.num_attention_heads=3"]),
    ("model-hidden-0", ["model.hidden_size=0"], ["model.hidden_size=0"]),
    ("lora-rank", ["model.lora.r=-1"], ["model.lora.r=-1"]),
    ("pretrained-missing", ["model.pretrained=/nonexistent/ckpt"], ["/nonexistent/ckpt"]),
    ("seq-len-0", ["task.seq_len=0"], ["task.seq_len=0"]),
    ("group-size-0", ["task.group_size=0"], ["task.group_size=0"]),
    ("temperature", ["task.temperature=-1"], ["temperature=-1.0"]),
    ("top-p", ["task.top_p=2"], ["top_p=2.0"]),
    ("loss-type", ["task.loss_type=bogus"], ["'bogus'"]),
    ("lr", ["task.lr=-1"], ["lr=-1.0"]),
    ("lr-schedule", ["task.lr_schedule=bogus"], ["'bogus'"]),
    ("logits-chunk", ["memory.logits_chunk_size=0"], ["logits_chunk_size=0"]),
    ("trainer-key", ["trainer.max_stepz=3"], ["trainer.max_stepz"]),
    ("data-file-missing", ["task=text_sft", f"task.data.path={MISSING}"], [f"task.data.path='{MISSING}'"]),
    ("tokenizer-null", ["task=text_grpo", f"task.data.path={MISSING}"], ["tokenizer_path is null"]),
    ("tokenizer-missing", ["task=text_grpo", "tokenizer.path=/nonexistent/tok"], ["'/nonexistent/tok'"]),
    ("logger-target", ["logger.mine={kind: bogus}"], ["logger.mine must be a _target_ node", "'kind': 'bogus'"]),
    ("checkpoint-every", ["checkpoint.every_n_steps=0"], ["checkpoint.every_n_steps=0"]),
    ("nonfinite-policy", ["on_nonfinite=bogus"], ["on_nonfinite='bogus'"]),
]


@pytest.mark.parametrize("overrides, fragments", [c[1:] for c in TRAIN], ids=[c[0] for c in TRAIN])
def test_longctx_train_refuses_before_any_work(no_work, overrides, fragments):
    from lightning_longctx.config_checks import ConfigError

    refused(lambda: no_work.run_train(compose_cfg(*overrides)), ConfigError, *fragments)


def test_longctx_train_refuses_a_missing_checkpoint_to_resume(no_work):
    refused(lambda: no_work.run_train(compose_cfg("ckpt_path=/nonexistent/last.ckpt")), FileNotFoundError,
            "ckpt_path=/nonexistent/last.ckpt")


@pytest.mark.parametrize("override, key", [("model.hiden_size=128", "hiden_size"),
                                           ("task.group_size=1.5", "group_size"), ("seed=abc", "seed"),
                                           ("model=llama9_1t", "llama9_1t")],
                         ids=["unknown-key", "wrong-type", "wrong-type-top-level", "unknown-preset"])
def test_hydra_refuses_unknown_keys_and_wrong_types(override, key):
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg(override)
    assert key in f"{err.value} {err.value.__cause__}"


PLAN = [("sp-size-3", "cluster.sp_size=3", "sp_size=3"), ("devices-0", "cluster.devices=0", "devices=0"),
        ("seq-len", "plan.seq_len=-5", "seq_len=-5"), ("model-heads", "model.num_attention_heads=3",
                                                       "num_attention_heads=3")]


@pytest.mark.parametrize("override, fragment", [c[1:] for c in PLAN], ids=[c[0] for c in PLAN])
def test_longctx_plan_refuses(override, fragment):
    from lightning_longctx import cli

    refused(lambda: cli.format_plan(compose_cfg(override, config_name="plan")), ValueError, fragment)


@pytest.mark.parametrize("script, override, message", [  # in-process above: every longctx-train case is a ConfigError
    ("longctx-train", "cluster.sp_size=3", "sp_size=3"),
    ("longctx-plan", "cluster.sp_size=3", "sp_size=3"),
], ids=["train-sp-size", "plan-sp-size"])
def test_console_scripts_print_the_message_alone(tmp_path, script, override, message):
    out = subprocess.run([str(Path(sys.executable).parent / script), override, f"hydra.run.dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    assert "longctx: error:" in out.stderr and message in out.stderr, text[-3000:]
    assert "Traceback" not in text and "Initializing distributed" not in text, text[-3000:]
