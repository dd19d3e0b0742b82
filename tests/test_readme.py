"""The README and ``docs/memory_planner.md`` must not lie: every ```python block of the README runs (and the
planner doc's), and every ``longctx-plan`` / ``longctx-train`` command in their ```bash blocks is re-run
in-process with the lines written under it compared with what it prints.

Conventions the docs follow (and this test reads):

- a python block runs as written in a namespace holding the few names it leaves to the reader (``q``, ``k``,
  ``v``, ``sp_group``, ``model``, ``prompt_ids``, ``reward_fn``, ``dataloader``, ...: tiny CPU stand-ins
  below); in the SFT block the checkpoint path and the GPU Trainer arguments are swapped for a tiny saved model
  and one CPU step (each swapped string must be in the block: a rewrite of the README fails here);
- in a bash block, a ``.venv/bin/longctx-plan <overrides>`` line is composed as the console script composes it
  (``config_name="plan"``) and printed with ``cli.format_plan``; a ``.venv/bin/longctx-train <overrides>`` line
  is planned with ``cli.check_plan`` (the refusal message before any work). The ``# ...`` lines right under a
  command are its expected output: each ``...``-separated piece must appear in what it prints (whitespace
  runs compared as one space);
- every figure of a million or more written with thousands separators in the README's text (outside code
  blocks) must be printed by one of those commands.
"""

from __future__ import annotations

import re
import shlex
import textwrap
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

import fresh_python

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", ROOT / "docs" / "memory_planner.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
COMMAND = re.compile(r"^\.venv/bin/(longctx-plan|longctx-train)((?: [^#\s]+)*)\s*$")  # no trailing comment
BIG_FIGURE = re.compile(r"\b\d{1,3}(?:,\d{3}){2,}\b")  # 1,234,567 and up


def blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang == language]


def commands(path: Path) -> list[tuple[str, tuple[str, ...], list[str]]]:
    """``(script, overrides, expected lines)`` for each console-script command line of the bash blocks."""
    found = []
    for body in blocks(path, "bash"):
        lines = body.replace("\\\n", " ").splitlines()  # a continued command is one line
        for index, line in enumerate(lines):
            match = COMMAND.match(line)
            if not match:
                continue
            expected = []
            for following in lines[index + 1:]:
                if not following.startswith("#"):
                    break
                expected.append(following.lstrip("#").strip())
            if match.group(1) == "longctx-plan" or expected:  # a training command is checked for its refusal only
                found.append((match.group(1), tuple(shlex.split(match.group(2))), expected))
    return found


def squash(text: str) -> str:
    return " ".join(text.split())


def printed(script: str, overrides: tuple[str, ...]) -> str:
    """What the command prints (longctx-plan) or refuses with (longctx-train's plan check), in-process."""
    from lightning_longctx import cli
    from lightning_longctx.planner import PlanError

    with initialize_config_module(config_module="lightning_longctx.conf", version_base="1.3"):
        cfg = compose(config_name="plan" if script == "longctx-plan" else "config", overrides=list(overrides))
    if script == "longctx-plan":
        return cli.format_plan(cfg)
    try:
        plan = cli.check_plan(cfg)
    except PlanError as err:
        return str(err)
    return f"memory plan: {plan.total_gib:.3f} GiB/rank peak ({plan.peak_phase})"


@pytest.fixture(autouse=True)
def console_script_environment(monkeypatch):
    """As under the console scripts: PYTORCH_CUDA_ALLOC_CONF unset (they set expandable_segments:True)."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)


@pytest.fixture(scope="module")
def outputs() -> dict[tuple[str, tuple[str, ...]], str]:
    return {(script, overrides): printed(script, overrides)
            for path in DOCS for script, overrides, _ in commands(path)}


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_the_lines_under_each_command_are_what_it_prints(path, outputs, monkeypatch):
    found = commands(path)
    assert found, f"{path.name} shows no longctx-plan / longctx-train command"
    failures = []
    for script, overrides, expected in found:
        text = squash(outputs[script, overrides])
        for line in expected:
            for piece in (squash(p) for p in line.split("...")):
                if piece and piece not in text:
                    failures.append(f"{script} {' '.join(overrides)}: {piece!r} not in its output:\n{text}")
    assert not failures, "\n\n".join(failures)


def test_every_big_figure_of_the_readme_text_is_printed_by_a_command(outputs):
    readme = FENCE.sub("", DOCS[0].read_text())
    printed_text = "\n".join(outputs.values())
    missing = sorted(set(BIG_FIGURE.findall(readme)) - set(BIG_FIGURE.findall(printed_text)))
    assert not missing, f"README figures no command of the README / planner doc prints: {missing}"


def test_subpackages_are_attributes_after_a_bare_import():
    """The README's ``lightning_longctx.models.DecoderLM`` after ``import lightning_longctx`` (a fresh
    interpreter: nothing else imported the subpackage first)."""
    code = "import lightning_longctx as L; print(L.models.DecoderLM.__name__, L.planner.plan)"
    out = fresh_python.run(code, timeout=120, cwd=ROOT)  # python -c, forked after torch's import
    assert out.returncode == 0 and out.stdout.startswith("DecoderLM"), out.stderr


# ---------------------------------------------------------------------------------------------- python blocks
VOCAB = 32


def tiny_model(seed: int = 0):
    from lightning_longctx.models import DecoderConfig, DecoderLM

    torch.manual_seed(seed)
    return DecoderLM(DecoderConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8))


def readme_block(containing: str) -> str:
    matches = [b for b in blocks(DOCS[0], "python") if containing in b]
    assert len(matches) == 1, f"{len(matches)} README python blocks contain {containing!r}"
    return matches[0]


def swap(block: str, old: str, new: str) -> str:
    assert old in block, f"the README block no longer has {old!r}: update tests/test_readme.py with it"
    return block.replace(old, new)


def test_every_readme_python_block_is_run_here():
    ran = ("ulysses_attention(", "class SFT(", "longstraw_step(")
    for body in blocks(DOCS[0], "python"):
        assert any(marker in body for marker in ran), f"a README python block this test does not run:\n{body}"


def test_the_ulysses_attention_block_runs():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 12, 4, 8, generator=gen)
    k, v = torch.randn(1, 12, 2, 8, generator=gen), torch.randn(1, 12, 2, 8, generator=gen)
    scope = dict(q=q, k=k, v=v, sp_group=None)  # one process: the whole sequence is local
    exec(readme_block("ulysses_attention("), scope)
    assert scope["out"].shape == q.shape


def test_the_sft_block_runs(tmp_path, leave_no_process_group):
    from torch.utils.data import DataLoader

    checkpoint = tmp_path / "ckpt"
    tiny_model().save_pretrained(checkpoint)
    block = swap(readme_block("class SFT("), '"/path/to/hf/checkpoint"', repr(str(checkpoint)))
    block = swap(block, 'accelerator="gpu", devices=8', f'accelerator="cpu", devices=1, max_steps=1, logger=False, '
                 f'enable_checkpointing=False, enable_progress_bar=False, default_root_dir={str(tmp_path)!r}')
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt without loss
    scope = {"dataloader": DataLoader([{"input_ids": ids, "labels": labels}], batch_size=None)}
    exec(textwrap.dedent(block), scope)
    assert scope["trainer"].global_step == 1


def test_the_longstraw_block_runs():
    from lightning_longctx.longstraw import longstraw_step

    model, ref_model = tiny_model(0), tiny_model(1)
    prompt_ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(2))
    scope = dict(model=model, ref_model=ref_model, prompt_ids=prompt_ids, sp_group=None,
                 reward_fn=lambda responses: torch.arange(len(responses), dtype=torch.float32),
                 optimizer=torch.optim.SGD(model.parameters(), lr=1e-3))
    exec(swap(readme_block("longstraw_step("), "max_new_tokens=256", "max_new_tokens=8"), scope)  # seconds, not 30
    assert len(scope["responses"]) == 8 and torch.isfinite(torch.as_tensor(scope["out"].loss))
    assert longstraw_step is scope["longstraw_step"]


def test_the_planner_doc_python_block_runs():
    import yaml

    def preset(group, name):
        return yaml.safe_load((ROOT / "conf" / group / f"{name}.yaml").read_text())

    (block,) = blocks(DOCS[1], "python")
    scope = dict(model_cfg=preset("model", "llama3_8b"), cluster_cfg=preset("cluster", "node_8gpu"),
                 memory_cfg=preset("memory", "h100_80g"))
    exec(block, scope)
    assert scope["p"].seq_len == 1 << 20
