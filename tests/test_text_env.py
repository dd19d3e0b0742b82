"""``task=text_grpo`` with ``task.env``: a user's environment written in text, wrapped with the run's tokenizer
(tasks/text_env.py), between generation turns; the reward functions get the episodes' texts.

On the tiny word-level tokenizer and random Qwen3 checkpoint of ``examples/text_grpo`` (tests/conftest.py's
``hf_dir`` / ``qa_jsonl``) and the example environment ``examples/text_grpo/search_env.py``.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hydra import compose, initialize_config_module

from lightning_longctx import cli
from lightning_longctx.config_checks import ConfigError, check_config
from lightning_longctx.tasks.text_env import TokenizedEnvironment, episode_texts, turn_end_id

pytestmark = pytest.mark.usefixtures("leave_no_process_group")

RECORDER = '''
CALLS = []


def record(completions, completion_ids, observations, env_rewards, environments, answer, **kwargs):
    CALLS.append({"completions": completions, "completion_ids": completion_ids, "observations": observations,
                  "env_rewards": env_rewards, "searches": [list(env.searches) for env in environments],
                  "answer": answer})
    return [float(len(o)) for o in observations]
'''


@pytest.fixture(scope="module")
def tokenizer(hf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


def compose_text(hf_dir, qa_jsonl, tmp_path, *overrides):
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        return compose(config_name="config", overrides=[
            "task=text_grpo", f"model.pretrained={hf_dir}", f"tokenizer.path={hf_dir}", f"task.data.path={qa_jsonl}",
            "trainer=smoke", "cluster.devices=1", "task.seq_len=64", f"logger.tensorboard.save_dir={tmp_path}",
            f"trainer.default_root_dir={tmp_path}", *overrides])


class NoStep:
    def reset(self, example):
        return ""


class Echo:
    """Writes the prompt as its context; answers a turn with the turn's text and one more word."""

    def reset(self, example):
        return example["prompt"]

    def step(self, turn_text):
        return turn_text + " river", 0.5, False


def test_turn_end_is_one_token_and_a_turn_decodes_without_its_stop_id(tokenizer):
    question = tokenizer.convert_tokens_to_ids("?")
    assert turn_end_id(tokenizer, "?") == question and turn_end_id(tokenizer, None) is None
    with pytest.raises(ValueError, match=r"task.turn_end='magic word' is 2 tokens \['magic', 'word'\]"):
        turn_end_id(tokenizer, "magic word")
    eos = tokenizer.eos_token_id
    wrapped = TokenizedEnvironment(Echo(), tokenizer, [eos])
    ids = tokenizer.convert_tokens_to_ids(["the", "magic", "word", "?"])
    assert wrapped.reset({"prompt": "the magic", "prompt_ids": torch.tensor([0])}) == ids[:2]
    # the episode's EOS is no text; the rest decodes as drawn, special tokens kept
    observation, reward, done = wrapped.step([*ids, tokenizer.convert_tokens_to_ids("<|im_start|>"), eos])
    assert tokenizer.convert_ids_to_tokens(observation) == ["the", "magic", "word", "?", "<|im_start|>", "river"]
    assert (reward, done) == (0.5, False)
    response = torch.tensor([*ids[:2], *ids[2:], eos])
    mask = torch.tensor([True, True, False, False, True])
    completion, observations, messages = episode_texts(tokenizer, response, mask)
    assert completion == "the magic word?" and observations == ["word?"]  # the decoder's spacing
    assert messages == [{"role": "assistant", "content": "the magic"}, {"role": "tool", "content": "word?"},
                        {"role": "assistant", "content": ""}]


def test_an_environment_without_step_or_a_marker_of_two_tokens_is_refused_before_any_work(hf_dir, qa_jsonl,
                                                                                          tmp_path):
    cfg = compose_text(hf_dir, qa_jsonl, tmp_path, "task.reward_funcs=[lightning_longctx.tasks.rewards."
                       "environment_reward]", f"task.env._target_={__name__}.NoStep")
    with pytest.raises(ConfigError, match=r"task.env._target_='test_text_env.NoStep'.*\(in text\); NoStep lacks "
                                          r"\['step'\]"):
        check_config(cfg)
    cfg = compose_text(hf_dir, qa_jsonl, tmp_path, "task.reward_funcs=[lightning_longctx.tasks.rewards."
                       "environment_reward]", "task.env._target_=search_env.DocumentSearch",
                       "task.turn_end='magic word'")
    with pytest.raises(ConfigError, match=r"task.turn_end='magic word' is 2 tokens"):
        check_config(cfg)


def test_longctx_train_text_grpo_with_a_text_environment(hf_dir, qa_jsonl, tmp_path, monkeypatch, tokenizer):
    """Two ``longctx-train`` steps, the document search answering: the masks cover exactly the observations'
    tokens, which decode back to the environment's text; the reward function saw the episodes' texts."""
    from lightning_longctx.longstraw import longstraw_step
    from lightning_longctx.training import longstraw_module

    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    (tmp_path / "env_recorder.py").write_text(RECORDER)
    steps = []

    def step(model, prompt, responses, *args, response_masks=None, **kwargs):
        steps.append((list(responses), response_masks))
        return longstraw_step(model, prompt, responses, *args, response_masks=response_masks, **kwargs)

    monkeypatch.setattr(longstraw_module, "longstraw_step", step)
    cfg = compose_text(hf_dir, qa_jsonl, tmp_path, "task.reward_funcs=[env_recorder.record,lightning_longctx.tasks."
                       "rewards.environment_reward]", "task.env._target_=search_env.DocumentSearch",
                       "+task.env.min_searches=1", "task.turn_end='?'", "task.max_turn_tokens=3",
                       "task.max_new_tokens=24", "task.group_size=3", "task.log_completions_every_n_steps=null")
    trainer = cli.run_train(cfg)
    assert trainer.global_step == 2
    module = trainer.lightning_module
    assert module.turn_kwargs["turn_end_ids"] == (tokenizer.convert_tokens_to_ids("?"),)
    calls = sys.modules.pop("env_recorder").CALLS[1:]  # the dry call first: no observations
    assert len(calls) == len(steps) == 2 and trainer.callback_metrics["train/env_tokens"] > 0
    observed = 0
    for call, (responses, masks) in zip(calls, steps):
        for i, (response, mask) in enumerate(zip(responses, masks)):
            searches, observations = call["searches"][i], call["observations"][i]
            # every search was answered; the last answer is dropped when the episode ended on that turn
            assert observations == searches[:len(observations)] and len(searches) - len(observations) in (0, 1)
            written = response[~mask].tolist()
            assert written == [t for s in observations for t in tokenizer(s, add_special_tokens=False)["input_ids"]]
            assert call["completion_ids"][i] == response.tolist()
            assert call["completions"][i] == tokenizer.decode(response.tolist(), skip_special_tokens=True)
            assert all(s in call["completions"][i] for s in observations)  # the completion holds the tool's text
            observed += len(observations)
        assert set(call["env_rewards"]) <= {0.0, 1.0}
    assert observed > 0
    assert trainer.callback_metrics["train/rewards/environment_reward/mean"] >= 0


def test_a_chat_prompts_reward_functions_get_trl_messages_with_the_tool_turns(hf_dir, tokenizer, tmp_path,
                                                                              monkeypatch):
    """For a chat prompt ``completions`` are TRL's message lists (``assistant`` / ``tool``); the environment
    object is copied per branch, the tokenizer shared."""
    import copy

    from lightning_longctx.longstraw.episodes import Episode
    from lightning_longctx.models import DecoderLM
    from lightning_longctx.tasks.text_grpo import TextGRPOModule

    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    (tmp_path / "env_recorder_chat.py").write_text(RECORDER)
    module = TextGRPOModule(DecoderLM.from_pretrained(hf_dir), tokenizer_path=str(hf_dir), group_size=2,
                            reward_funcs=["env_recorder_chat.record"], env={"_target_": f"{__name__}.Echo"},
                            turn_end="?", max_turn_tokens=4)
    branch = copy.deepcopy(module.env)
    assert isinstance(branch.env, Echo) and branch.env is not module.env.env and branch.tokenizer is module.tokenizer
    branch.env.searches = ["word"]
    ids = tokenizer.convert_tokens_to_ids(["the", "magic", "word", "?", "falcon", "<|im_end|>"])
    mask = torch.tensor([True, True, False, False, True, True])
    episodes = [Episode(torch.tensor(ids), mask, 1.0, 2, branch), Episode(torch.tensor(ids[:2]), mask[:2], 0.0, 1,
                                                                          branch)]
    module.reward(torch.tensor(ids[:1]), [e.response for e in episodes], prompt=[{"role": "user", "content": "q"}],
                  episodes=episodes, answer="falcon")
    (call,) = sys.modules.pop("env_recorder_chat").CALLS
    assert call["completions"][0] == [{"role": "assistant", "content": "the magic"},
                                      {"role": "tool", "content": "word?"},
                                      {"role": "assistant", "content": "falcon"}]
    assert call["completions"][1] == [{"role": "assistant", "content": "the magic"}]
    assert call["observations"] == [["word?"], []] and call["env_rewards"] == [1.0, 0.0]
    assert call["searches"] == [["word"], ["word"]] and call["answer"] == ["falcon", "falcon"]
