"""Multi-turn tool rollouts (``sample_episodes``): the environment's tokens reach the model and carry mask 0.

The reference never touches ``lightning_longctx.longstraw``: the distribution each model token of an episode is
drawn from must be ``softmax`` of the model's plain ``forward`` over ``cat(prompt, response so far)``, the
environment's context and observations included (their tokens sit in the branch's cache at their positions:
were one missing, late or fed token by token wrongly, the next turn's logits would differ). Branches get
observations of different lengths (they leave their batch for one of their own), tool-call end markers and
``max_turn_tokens`` end turns; float64, dense, hybrid (Gated DeltaNet) and MLA models; one process and 2 gloo
SP ranks (the environments called on the first rank only).
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from lightning_longctx.longstraw import sample
from lightning_longctx.longstraw.episodes import EnvironmentFailure, sample_episodes
from mla_workers import mla_config, mla_model
from models_common import single_thread  # noqa: F401 - an autouse fixture
from sampling_workers import VOCAB, build_model, make_prompt

END_CALL = 5  # the scripted tool call's end marker
STOP = 7


class ScriptedTool:
    """A tool that answers turn ``k`` of branch ``branch`` with ``branch + k`` tokens (0: none) derived from the
    turn's tokens, rewards each turn 0.5 and says done after ``turns`` turns; ``reset`` writes a 2-token
    context. Records what it was shown."""

    def __init__(self, branch: int, turns: int = 3) -> None:
        self.branch, self.turns, self.shown, self.example = branch, turns, [], None

    def reset(self, example):
        self.example = example
        return [11, 12]

    def step(self, turn_tokens):
        self.shown.append(list(turn_tokens))
        k = len(self.shown)
        observation = [(t * 3 + k + i) % VOCAB for i, t in enumerate((turn_tokens * 4)[:self.branch + k - 1])]
        return observation, 0.5, k >= self.turns


def mla():
    return mla_model(mla_config())


def check_episode(model, prompt, episode, env, probs_at: dict[int, torch.Tensor]) -> None:
    """The mask says who wrote each token, the environment saw exactly the model's turns, and each drawn token's
    distribution is the full forward's over ``cat(prompt, response so far)``."""
    response, mask = episode.response, episode.mask
    assert mask.dtype == torch.bool and mask.shape == response.shape and mask[2:].any()
    assert mask[:2].tolist() == [False, False] and response[:2].tolist() == [11, 12]  # the reset's context
    assert sum(env.shown, []) == response[mask].tolist()  # every model token reached the environment once
    for turn in env.shown[:-1]:  # a turn ends at the marker or after max_turn_tokens
        assert turn[-1] == END_CALL or len(turn) == 3, env.shown
    assert episode.turns == len(env.shown) and episode.reward == 0.5 * len(env.shown)
    with torch.no_grad():
        logits = model(torch.cat([prompt, response])[None]).logits[0].double()
    s = prompt.numel()
    for t in mask.nonzero()[:, 0].tolist():
        want = torch.softmax(logits[s - 1 + t], dim=0)
        torch.testing.assert_close(probs_at[t], want, atol=1e-10, rtol=0)


def run_episodes(model, prompt, g, group=None, seed=0, **kwargs):
    envs = [ScriptedTool(i) for i in range(g)]
    probs: dict[tuple[int, int], torch.Tensor] = {}

    def on_step(step, rows, p):
        for row, row_probs in zip(rows.tolist(), p):
            probs[(row, step)] = row_probs.clone()

    episodes = sample_episodes(model, prompt, envs, {"answer": 3}, max_new_tokens=16, max_turn_tokens=3,
                               turn_end_ids=[END_CALL], eos_token_id=STOP, group=group,
                               generator=torch.Generator().manual_seed(seed), on_step=on_step, **kwargs)
    return episodes, envs, probs


@pytest.mark.parametrize("kind", ["plain", "hybrid", "mla"])
def test_episode_tokens_are_drawn_from_the_full_forward_over_the_branch_with_its_observations(kind):
    model = mla() if kind == "mla" else build_model(kind)
    prompt = make_prompt(17)
    episodes, envs, probs = run_episodes(model, prompt, 4)
    lengths = {e.response.numel() for e in episodes}
    assert len(lengths) > 1 and any(len(env.shown) > 1 for env in envs)  # the branches parted
    for i, (episode, env) in enumerate(zip(episodes, envs)):
        assert env.example["answer"] == 3 and torch.equal(env.example["prompt_ids"], prompt)
        check_episode(model, prompt, episode, env, {t: p for (row, t), p in probs.items() if row == i})
        assert episode.response.numel() <= 16


def test_a_bad_environment_is_named():
    class Broken(ScriptedTool):
        def step(self, turn_tokens):
            return [VOCAB + 3], 0.0, False

    model, prompt = build_model("plain"), make_prompt(9)
    with pytest.raises(EnvironmentFailure, match=r"env 0: step\(\)'s observation holds \[64\]"):
        sample_episodes(model, prompt, [Broken(0)], max_new_tokens=8, max_turn_tokens=2)
    with pytest.raises(TypeError, match=r"envs\[0\]=object must have reset.*lacks"):
        sample_episodes(model, prompt, [object()], max_new_tokens=8)
    with pytest.raises(ValueError, match="max_turn_tokens=0"):
        sample_episodes(model, prompt, [ScriptedTool(0)], max_new_tokens=8, max_turn_tokens=0)


def _sp_worker(rank, world):
    import torch.distributed as dist

    model, prompt = build_model("hybrid"), make_prompt(23)
    got, envs, _ = run_episodes(model, prompt, 3, group=dist.group.WORLD, seed=rank)  # rank 0's draws win
    want, _, _ = run_episodes(build_model("hybrid"), prompt, 3, seed=0)
    assert [e.response.tolist() for e in got] == [e.response.tolist() for e in want]
    assert [e.mask.tolist() for e in got] == [e.mask.tolist() for e in want]
    assert [e.reward for e in got] == [e.reward for e in want]
    return [len(env.shown) for env in envs]  # the environments ran on the first rank only


def test_episodes_under_sequence_parallelism_equal_one_process_and_ask_the_environment_once():
    shown = run_distributed(_sp_worker, 2, timeout=240)
    assert sum(shown[0]) > 0 and sum(shown[1]) == 0


def _fsdp_worker(rank, world, sync):
    """Each data-parallel rank its own prompt and stop point (and turns): rank 0's responses stop after their
    first token, rank 1's run to ``max_new_tokens``; FSDP2 all-gathers the parameters per layer and step.
    Without ``sync_group`` (``sync=False``) rank 1's second step meets no peer: gloo aborts on the collective
    mismatch (NCCL would hang)."""
    import torch.distributed as dist

    from lightning_longctx.models import DecoderConfig, DecoderLM
    from lightning_longctx.training.parallelize import parallelize, register_prefix_state_methods

    def policy():
        torch.manual_seed(0)
        return DecoderLM(DecoderConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       initializer_range=0.2))

    plain, sharded = policy(), policy()
    parallelize(sharded, [sharded], sp_group=None, sp_size=1, sharding="fsdp", head_chunk_size=None,
                device_type="cpu")
    register_prefix_state_methods([sharded])
    prompt = make_prompt(11 + rank, seed=rank)
    first = int(sample(plain, prompt, 1, max_new_tokens=1, temperature=0.0)[0][0])
    stop = first if rank == 0 else None  # rank 0 stops at once
    group = dist.group.WORLD if sync else None
    got = sample(sharded, prompt, 2, max_new_tokens=6, temperature=0.0, eos_token_id=stop, sync_group=group)
    want = sample(plain, prompt, 2, max_new_tokens=6, temperature=0.0, eos_token_id=stop)
    assert [r.tolist() for r in got] == [r.tolist() for r in want]
    turns = 1 if rank == 0 else 3  # and as many turns apart
    episodes = sample_episodes(sharded, prompt, [ScriptedTool(i, turns) for i in range(2)], max_new_tokens=12,
                               max_turn_tokens=2, temperature=0.0, sync_group=group)
    reference = sample_episodes(plain, prompt, [ScriptedTool(i, turns) for i in range(2)], max_new_tokens=12,
                                max_turn_tokens=2, temperature=0.0)
    assert [e.response.tolist() for e in episodes] == [e.response.tolist() for e in reference]
    return [len(r) for r in got]


def test_fsdp_data_parallel_ranks_that_stop_apart_decode_in_lockstep_without_a_hang():
    lengths = run_distributed(_fsdp_worker, 2, True, timeout=240)
    assert lengths == [[1, 1], [6, 6]]



class TurnsFromExample(ScriptedTool):
    """Done after the example's ``turns`` turns: prompts with different numbers of turns."""

    def reset(self, example):
        self.turns = int(example["turns"])
        return super().reset(example)


def _module_fit(rank, world):
    """``LongStrawModule(env=...)`` under ``Trainer(strategy=UlyssesStrategy(sp_size=1, sharding="fsdp"))`` on 2
    data-parallel ranks whose prompts want 1 and 4 turns: one training step."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_longctx import LongStrawModule, UlyssesStrategy
    from lightning_longctx.models import DecoderConfig, DecoderLM
    from lightning_longctx.tasks.needle import collate_prompt_groups

    seen = []

    class Recording(LongStrawModule):
        def reward(self, prompt_ids, responses, **fields):
            seen.append([e.turns for e in fields["episodes"]])
            return super().reward(prompt_ids, responses, **fields)

    torch.manual_seed(0)
    policy = DecoderLM(DecoderConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.2))
    module = Recording(policy, group_size=2, max_new_tokens=16, env=TurnsFromExample(0), max_turn_tokens=2)
    rows = [{"prompt_ids": make_prompt(9 + i, seed=i), "turns": 1 + 3 * i} for i in range(2)]
    trainer = pl.Trainer(strategy=UlyssesStrategy(sp_size=1, sharding="fsdp"), accelerator="cpu", devices=world,
                         max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, DataLoader(rows, batch_size=1, collate_fn=collate_prompt_groups))
    return seen


def test_a_module_with_an_environment_trains_on_fsdp_data_parallel_ranks_whose_episodes_differ():
    seen = run_distributed(_module_fit, 2, timeout=300, init_group=False)
    assert sorted(s[0][0] for s in seen) == [1, 4]  # one rank's episodes ended after 1 turn, the other's after 4
