"""Write a small long-context QA data set: a long filler document with one fact hidden in it, and a question.

Each GRPO row is ``{"prompt": "<document> question : what is the magic word ? answer :", "answer": "falcon",
"depth": 0.37}``: the ``prompt`` column is what the policy reads, every other column (``answer``, ``depth``)
reaches the reward functions (``rewards.py``) as a keyword argument. ``--sft`` writes chat records instead
(``{"messages": [{"role": "user", ...}, {"role": "assistant", "content": "falcon"}]}``) for ``task=text_sft``.

    python make_data.py --out data/train.jsonl --rows 64 --words 300
    python make_data.py --out data/sft.jsonl --rows 64 --words 300 --sft
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

_FILLER_TEXT = """
the a old new river hill town road mill field stone tree house garden bridge market winter summer morning
evening rain wind light dark green blue quiet busy slowly often never always walked stood looked passed
carried opened closed found kept near under over behind beyond across with without and but then while
farmer baker teacher child dog cat horse boat cart lamp door window wall roof path gate well bell
"""
FILLER = tuple(_FILLER_TEXT.split())
KEYS = ("falcon", "otter", "maple", "cobalt", "ember", "lotus", "quartz", "willow")
QUESTION = "question : what is the magic word ? answer :"


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(FILLER) for _ in range(rng.randint(6, 12))) + " ."


def make_row(index: int, words: int, seed: int = 0) -> dict:
    """One QA row: a document of about ``words`` filler words with ``the magic word is <key> .`` at a random
    depth, then :data:`QUESTION`. Deterministic per ``(seed, index)``."""
    rng = random.Random(seed * 1_000_003 + index)
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        sentences.append(_sentence(rng))
    key = rng.choice(KEYS)
    depth = rng.randint(0, len(sentences))
    sentences.insert(depth, f"the magic word is {key} .")
    return {"prompt": " ".join(sentences) + " " + QUESTION, "answer": key,
            "depth": round(depth / max(1, len(sentences) - 1), 3)}


def make_rows(num_rows: int, words: int, seed: int = 0) -> list[dict]:
    return [make_row(i, words, seed) for i in range(num_rows)]


def make_chat_records(num_rows: int, words: int, seed: int = 0) -> list[dict]:
    """SFT chat records: the QA row as a user turn and its answer as the assistant turn."""
    return [{"messages": [{"role": "system", "content": "answer with one word ."},
                          {"role": "user", "content": row["prompt"]},
                          {"role": "assistant", "content": row["answer"]}]}
            for row in make_rows(num_rows, words, seed)]


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/train.jsonl")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--words", type=int, default=300, help="filler words per document")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft", action="store_true", help="chat records (messages) for task=text_sft")
    args = parser.parse_args(argv)
    rows = (make_chat_records if args.sft else make_rows)(args.rows, args.words, args.seed)
    print(f"wrote {len(rows)} rows to {write_jsonl(args.out, rows)}")


if __name__ == "__main__":
    main()
