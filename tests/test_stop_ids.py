"""task=text_grpo stops responses at every stop id the checkpoint knows: the tokenizer's EOS and the
``eos_token_id`` list of the checkpoint's ``generation_config.json`` (else its ``config.json``), as transformers'
``generate`` reads them. The checkpoint is the example's tiny Qwen3 + word-level tokenizer (EOS ``<|im_end|>``),
with a ``generation_config.json`` that lists ``[<|im_end|>, <|endoftext|>]``; the sampling itself (a response
stops at the first of several ids) is tested against a reference loop in ``test_sampling.py``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.utils import instantiate

pytest.importorskip("transformers")

from lightning_longctx.tasks.text_data import checkpoint_eos_ids, stop_ids  # noqa: E402
from lightning_longctx.tasks.text_grpo import TextGRPOModule  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "text_grpo"
sys.path.insert(0, str(EXAMPLE))
import make_model  # noqa: E402


def constant(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory) -> tuple[Path, int, int]:
    """The tiny checkpoint, its generation_config.json listing two stop ids; returns (dir, im_end, other)."""
    from transformers import AutoTokenizer

    path = make_model.make_model(tmp_path_factory.mktemp("chat") / "ckpt")
    tok = AutoTokenizer.from_pretrained(path)
    im_end, other = tok.eos_token_id, tok.convert_tokens_to_ids("<pad>")  # <pad> plays <|endoftext|>
    assert im_end != other
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [im_end, other]}))
    return path, im_end, other


def module(path, **kwargs) -> TextGRPOModule:
    from lightning_longctx.models import DecoderLM

    return TextGRPOModule(DecoderLM.from_pretrained(path), tokenizer_path=str(path),
                          reward_funcs=[f"{__name__}.constant"], group_size=2, **kwargs)


def test_the_module_stops_at_the_tokenizers_eos_and_the_generation_configs(chat_ckpt):
    path, im_end, other = chat_ckpt
    both = module(path, generation_config_path=str(path))
    assert both.stop_token_ids == (im_end, other) and both.sample_kwargs["eos_token_id"] == (im_end, other)
    assert both.eos_token_id == im_end  # the dry call's empty completion ends with the tokenizer's EOS
    assert module(path).stop_token_ids == (im_end,)  # no checkpoint to read: the tokenizer's alone
    assert module(path, generation_config_path=str(path), eos_token_id=[other]).stop_token_ids == (other,)
    with pytest.raises(ValueError, match=r"token ids \[100000\] lie outside the vocabulary"):
        module(path, eos_token_id=[im_end, 100000])


def test_the_checkpoints_eos_ids_as_transformers_reads_them(chat_ckpt, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    path, im_end, other = chat_ckpt
    assert checkpoint_eos_ids(path) == GenerationConfig.from_pretrained(path).eos_token_id == [im_end, other]
    assert checkpoint_eos_ids(path / "generation_config.json") == [im_end, other]
    bare = tmp_path / "no_generation_config"
    shutil.copytree(path, bare)
    (bare / "generation_config.json").unlink()
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "eos_token_id": [other, im_end]}))
    assert checkpoint_eos_ids(bare) == [other, im_end]  # config.json, as generate falls back to it
    assert stop_ids(AutoTokenizer.from_pretrained(path), bare) == [im_end, other]  # the tokenizer's first, no repeats
    assert checkpoint_eos_ids(None) == [] and checkpoint_eos_ids(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="generation_config_path='.*nope' does not exist"):
        checkpoint_eos_ids(tmp_path / "nope")
    (tmp_path / "broken.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(ValueError, match=r"broken\.json: eos_token_id='x' must be a token id or a list"):
        checkpoint_eos_ids(tmp_path / "broken.json")


def test_the_task_yaml_reads_model_pretrained_s_generation_config(chat_ckpt):
    from lightning_longctx.models import DecoderLM

    path, im_end, other = chat_ckpt
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "task=text_grpo", f"model.pretrained={path}", "task.data.path=unused.jsonl",
            f"task.reward_funcs=[{__name__}.constant]"])
        listed = compose(config_name="config", overrides=[
            "task=text_grpo", f"model.pretrained={path}", "task.data.path=unused.jsonl",
            f"task.reward_funcs=[{__name__}.constant]", f"task.module.eos_token_id=[{other}]"])
    assert cfg.task.module.generation_config_path == str(path)
    built = instantiate(cfg.task.module, model=DecoderLM.from_pretrained(path), _convert_="all")
    assert built.stop_token_ids == (im_end, other)
    assert instantiate(listed.task.module, model=DecoderLM.from_pretrained(path),
                       _convert_="all").stop_token_ids == (other,)
