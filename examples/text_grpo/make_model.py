"""Build a tiny tokenizer and a tiny random HF checkpoint next to it: everything local, nothing downloaded.

The tokenizer is a word-level ``tokenizers`` model trained on the text of ``make_data.py``, wrapped as a
``transformers.PreTrainedTokenizerFast`` with ``<pad>``, ``<unk>``, the end-of-turn ``<|im_end|>`` as EOS and
a ChatML-style chat template whose assistant turns are marked with ``{% generation %}`` (so
``apply_chat_template(..., return_assistant_tokens_mask=True)`` works for ``task=text_sft``). The model is a
randomly initialised ``Qwen3ForCausalLM`` (or ``LlamaForCausalLM``) saved with ``save_pretrained``: a stand-in
for the real checkpoint you would pass as ``model.pretrained``.

    python make_model.py --out tiny_model          # writes tiny_model/{config.json,model.safetensors,tokenizer*}
"""

from __future__ import annotations

import argparse
from pathlib import Path

from make_data import make_chat_records, make_rows

SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(texts, chat_template: str | None = CHAT_TEMPLATE):
    """A word-level ``PreTrainedTokenizerFast`` over the words of ``texts`` (split on whitespace and
    punctuation), EOS ``<|im_end|>``, pad ``<pad>``; ``chat_template=None`` leaves the template out."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces, no space before punctuation
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL, min_frequency=1)
    tok.train_from_iterator(list(texts) + ["system user assistant"], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"],
                                   chat_template=chat_template, model_max_length=1 << 30)


def corpus(rows: int = 64, words: int = 300, seed: int = 0) -> list[str]:
    """The texts the tokenizer learns its words from: QA prompts, answers and chat records."""
    texts = [row["prompt"] + " " + row["answer"] for row in make_rows(rows, words, seed)]
    texts += [m["content"] for rec in make_chat_records(4, 20, seed) for m in rec["messages"]]
    return texts


def make_model(out: str | Path, *, arch: str = "qwen3", hidden_size: int = 64, num_layers: int = 2,
               chat_template: str | None = CHAT_TEMPLATE, seed: int = 0) -> Path:
    """Write ``out/``: the tokenizer of :func:`train_tokenizer` and a random tiny ``arch`` checkpoint (``qwen3``
    or ``llama``: 4 query heads, 2 K/V heads of dim 16, so it runs on 2 Ulysses ranks). Returns ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out = Path(out)
    tokenizer = train_tokenizer(corpus(seed=seed), chat_template=chat_template)
    classes = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
    config_cls, model_cls = classes[arch]
    config = config_cls(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=1 << 16, tie_word_embeddings=False,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        bos_token_id=None)
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="tiny_model")
    parser.add_argument("--arch", choices=("qwen3", "llama"), default="qwen3")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    out = make_model(args.out, arch=args.arch, hidden_size=args.hidden_size, num_layers=args.layers)
    print(f"wrote a tiny {args.arch} checkpoint and its tokenizer to {out}")


if __name__ == "__main__":
    main()
