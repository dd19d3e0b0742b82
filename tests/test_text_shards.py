"""Each data-parallel rank reads and tokenizes only its shard of the text tasks' data (issue 26): streamed
JSON-lines (``task.data.streaming``, :mod:`lightning_longctx.tasks.jsonl_shard`: each rank its byte range, line
by line), ``task=text_sft``'s rows (tokenized per shard, not on every rank), the shards padded to the longest
over the ranks, a streamed loader resumed exactly; and a prompt longer than ``task.seq_len`` refused by
``longctx-train`` before any rank starts, naming its row and length."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from distributed import run_distributed
from lightning_longctx.tasks import jsonl_shard
from lightning_longctx.tasks.jsonl_shard import read_shard, use_streaming
from traps_workers import padded_shards

pytestmark = pytest.mark.usefixtures("leave_no_process_group")  # tests/conftest.py (also hf_dir)


def _layout(rank: int, size: int) -> SimpleNamespace:
    """A Trainer as the data modules read it: the strategy's dp layout."""
    return SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": size, "rank": rank}))


def _write(path, rows, blank_after=()):
    path.write_text("".join(json.dumps(row) + "\n" + ("\n" if i in blank_after else "") for i, row in enumerate(rows)))
    return path


@pytest.fixture
def counting(hf_dir, monkeypatch):
    """``(tokenizer, encoded, parsed)``: the checkpoint's tokenizer recording each text it encodes, and the byte
    offsets of the JSON lines ``jsonl_shard`` parses."""
    from transformers import AutoTokenizer

    tokenizer, encoded, parsed = AutoTokenizer.from_pretrained(str(hf_dir)), [], []

    class Counting:
        chat_template = None
        eos_token_id, pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id

        def __call__(self, text):
            encoded.append(text)
            return tokenizer(text)

    parse = jsonl_shard._parse

    def recording(file, offset, raw, fields):
        row = parse(file, offset, raw, fields)
        if row is not None:  # a blank line is no row
            parsed.append(offset)
        return row

    monkeypatch.setattr(jsonl_shard, "_parse", recording)
    return Counting(), encoded, parsed


def test_streamed_jsonl_ranks_parse_and_tokenize_only_their_byte_range_and_resume_exactly(tmp_path, counting):
    """9 rows of different lengths (a blank line among them) on dp=2, streamed: each rank parses only the lines
    that start in its half of the bytes (the line across the cut: the rank it starts in) and tokenizes only
    their prompts; the two shards are the file's rows in order, disjoint; a loader resumed after 2 batches
    yields what the uninterrupted one does next."""
    import make_data  # examples/text_grpo, on sys.path through the hf_dir fixture

    from lightning_longctx.tasks.text_data import TextPromptData
    from lightning_longctx.training.dataloader import make_resumable

    tokenizer, encoded, parsed = counting
    rows = [dict(row, prompt=row["prompt"] * (1 + i % 3)) for i, row in enumerate(make_data.make_rows(9, 12, seed=4))]
    path = _write(tmp_path / "rows.jsonl", rows, blank_after=(4,))
    starts, offset = [], 0
    for line in path.read_bytes().splitlines(keepends=True):
        if line.strip():
            starts.append(offset)
        offset += len(line)
    half = path.stat().st_size // 2
    shards = []
    for rank in (0, 1):
        encoded.clear(), parsed.clear()
        data = TextPromptData(str(path), seq_len=512, tokenizer=tokenizer, shuffle=True, seed=5, streaming=True)
        assert data.streaming and not encoded and parsed == [0]  # before launch: the first line (its columns)
        parsed.clear()
        data.trainer = _layout(rank, 2)
        data.setup("fit")
        mine = [s for s in starts if (s < half) == (rank == 0)]
        assert parsed == mine, rank  # only its own lines
        shards.append(list(data.rows.prompts))
        assert encoded == shards[-1] and data.rows.columns["answer"] == [rows[starts.index(s)]["answer"]
                                                                          for s in mine]
        loader = make_resumable(data.train_dataloader())
        loader.sampler.set_epoch(0)
        full = [batch["prompt"][0] for batch in loader]
        iterator = iter(loader)
        next(iterator), next(iterator)
        resumed = make_resumable(data.train_dataloader())
        resumed.load_state_dict(loader.state_dict())
        assert [batch["prompt"][0] for batch in resumed] == full[2:], rank
    assert shards[0] + shards[1] == [row["prompt"] for row in rows] and shards[0] and shards[1]


def test_text_sft_ranks_tokenize_only_their_shard(tmp_path, counting):
    """``task=text_sft`` (TextSFTData): nothing is tokenized when the data module is built (before launch, and
    on every rank), and each dp rank of 2 tokenizes only its contiguous half of the documents."""
    import make_data

    from lightning_longctx.tasks.text_sft import TextSFTData

    tokenizer, encoded, _ = counting
    docs = [{"text": row["prompt"]} for row in make_data.make_rows(5, 10, seed=1)]
    path = _write(tmp_path / "docs.jsonl", docs)
    for rank, mine in ((0, docs[:3]), (1, docs[3:])):
        encoded.clear()
        data = TextSFTData(str(path), seq_len=512, tokenizer=tokenizer, text_field="text", shuffle=False)
        assert not encoded
        data.trainer = _layout(rank, 2)
        data.setup("fit")
        assert encoded == [d["text"] for d in mine] and len(data.samples) == len(mine), rank


def test_shards_are_padded_to_the_longest_over_the_ranks(hf_dir, tmp_path):
    """2 gloo ranks: a streamed shard with fewer rows, and a packed SFT shard with fewer sequences, are padded
    by repeating their first ones, so both ranks run as many steps."""
    import make_data

    rows = make_data.make_rows(3, 8, seed=2)
    rows[0]["prompt"] = rows[0]["prompt"] * 6  # rank 0's byte range: this row alone
    prompts = _write(tmp_path / "rows.jsonl", rows)
    docs = _write(tmp_path / "docs.jsonl", [{"text": " ".join(["word"] * n)} for n in (40, 3, 3)])
    first, second = run_distributed(padded_shards, 2, str(hf_dir), str(prompts), str(docs), timeout=180.0)
    assert first["prompts"] == [rows[0]["prompt"]] * 2 and second["prompts"] == [rows[1]["prompt"], rows[2]["prompt"]]
    assert len(first["sequences"]) == len(second["sequences"]) > 1


def test_streaming_auto_is_for_large_jsonl_files_only(tmp_path, monkeypatch):
    small = _write(tmp_path / "small.jsonl", [{"prompt": "a"}])
    (tmp_path / "rows.csv").write_text("prompt\na\n")
    assert not use_streaming(small, "auto") and use_streaming(small, True) and not use_streaming(small, False)
    monkeypatch.setattr(jsonl_shard, "STREAM_ABOVE_BYTES", 4)
    assert use_streaming(small, "auto") and use_streaming(tmp_path, "auto") is False  # a folder of two formats
    with pytest.raises(ValueError, match=r"streaming=true reads JSON-lines files .*rows\.csv. is not"):
        use_streaming(tmp_path / "rows.csv", True)
    with pytest.raises(ValueError, match=r"task.data.streaming='yes' must be one of auto, true, false"):
        use_streaming(small, "yes")


def test_a_streamed_line_that_is_not_json_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": \n{"answer": 1}\n')
    with pytest.raises(ValueError, match=rf"{path}:4: not JSON"):
        list(read_shard([path], 0, 1, ["prompt"]))
    path.write_text('{"prompt": "a"}\n{"answer": 1}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: no 'prompt' field, or null"):
        list(read_shard([path], 1, 2, ["prompt"]))


def test_a_too_long_prompt_is_refused_before_launch_naming_its_row_and_length(hf_dir, tmp_path, monkeypatch,
                                                                            caplog):
    """``longctx-train task=text_grpo``: a prompt longer than ``task.seq_len`` in local data stops the run in the
    launching process, before ``fit`` starts any rank, naming the row of the whole data set and its length;
    streamed data is not scanned there (each rank refuses it when it reads it), and says so."""
    import lightning.pytorch as pl
    from hydra import compose, initialize_config_module

    from lightning_longctx import cli
    from lightning_longctx.config_checks import ConfigError
    from lightning_longctx.tasks.text_data import TextPromptData

    rows = [{"prompt": "the magic word is ember ."}] * 3 + [{"prompt": " ".join(["word"] * 80)}]
    path = _write(tmp_path / "rows.jsonl", rows)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "build_loggers", lambda cfg: [])

    def forbidden(*args, **kwargs):
        raise AssertionError("fit started before the data was checked")

    monkeypatch.setattr(pl.Trainer, "fit", forbidden)
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "task=text_grpo", f"model.pretrained={hf_dir}", f"task.data.path={path}", "task.seq_len=50",
            "task.reward_funcs=[lightning_longctx.tasks.rewards.environment_reward]", "trainer=smoke",
            "plan.check=false"])
    length = len(TextPromptData(str(path), seq_len=512, tokenizer_path=str(hf_dir)).tokenizer(rows[3]["prompt"])[
        "input_ids"])
    with pytest.raises(ConfigError, match=rf"1 prompt\(s\) longer than task.seq_len=50 tokens: row 3 \({length} "
                                          rf"tokens\) \(the longest: {length} tokens\)"):
        cli.run_train(cfg)
    streamed = TextPromptData(str(path), seq_len=50, tokenizer_path=str(hf_dir), streaming=True)
    with caplog.at_level(logging.INFO, logger="lightning_longctx.tasks.text_data"):
        assert streamed.check_before_launch() is False
    assert "is not scanned for prompts longer than task.seq_len=50 before launch: each rank checks its shard" \
        in caplog.text
    with pytest.raises(ValueError, match=rf"1 prompt\(s\) longer than task.seq_len=50 tokens: {path}:4 \({length} "):
        streamed.shard_rows()


def test_a_too_long_held_out_prompt_is_refused_before_launch_naming_eval_data(hf_dir, tmp_path, monkeypatch):
    """``task.eval_data`` (held-out prompts, ``task.eval_every_n_steps > 0``) gets the training data's check: a
    prompt longer than ``task.seq_len`` stops ``longctx-train`` before ``fit``, naming ``task.eval_data``, the
    row and its length (the training data, all short, passes)."""
    import lightning.pytorch as pl
    from hydra import compose, initialize_config_module

    from lightning_longctx import cli
    from lightning_longctx.config_checks import ConfigError
    from lightning_longctx.tasks.text_data import TextPromptData

    short = {"prompt": "the magic word is ember ."}
    train = _write(tmp_path / "train.jsonl", [short] * 2)
    heldout = _write(tmp_path / "heldout.jsonl", [short, {"prompt": " ".join(["word"] * 80)}, short])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "build_loggers", lambda cfg: [])

    def forbidden(*args, **kwargs):
        raise AssertionError("fit started before the held-out data was checked")

    monkeypatch.setattr(pl.Trainer, "fit", forbidden)
    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "task=text_grpo", f"model.pretrained={hf_dir}", f"task.data.path={train}", "task.seq_len=50",
            "task.eval_every_n_steps=1", f"task.eval_data.path={heldout}",
            "task.reward_funcs=[lightning_longctx.tasks.rewards.environment_reward]", "trainer=smoke",
            "plan.check=false"])
    tokenizer = TextPromptData(str(train), seq_len=512, tokenizer_path=str(hf_dir)).tokenizer
    length = len(tokenizer(" ".join(["word"] * 80))["input_ids"])
    assert length > 50
    with pytest.raises(ConfigError, match=rf"^task.eval_data.path='{heldout}': 1 prompt\(s\) longer than "
                                          rf"task.seq_len=50 tokens: row 1 \({length} tokens\).*"
                                          r"task.eval_data.truncate=left"):
        cli.run_train(cfg)
