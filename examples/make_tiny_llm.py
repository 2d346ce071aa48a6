"""A tiny Llama-style model folder, its own tokenizer and a text file, made offline (no hub download).

The starting point of docs/finetune.md, for trying `hf:DIR` without a model of your own:

    pip install 'autofit[hf]'   # transformers (and tokenizers), PEFT, timm
    python examples/make_tiny_llm.py models/tiny-llama corpus.txt
    autofit plan hf:models/tiny-llama --task causal-lm --seq-len 32 --batch-size 4 --budget 64MB --out plan.json
    autofit train --plan plan.json --data corpus.txt --epochs 2

DIR gets what `from_pretrained` reads: config.json (a LlamaConfig, hidden size 64, 2 layers), the weights
(`save_pretrained`: model.safetensors) and a WordLevel tokenizer trained on the text with the `tokenizers` library
(tokenizer.json and its config, with <eos> and <pad>). The text file holds short sentences over a 19-word
vocabulary, one document per paragraph, in an order a model can learn. A model of your own is the same kind of
folder: on a machine that reaches the hub, `AutoModelForCausalLM.from_pretrained(name).save_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(name).save_pretrained(DIR)`.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

WORDS = "the a cat dog bird sat ran flew on under over mat log tree and then slept quickly slowly".split()


def sentences(count: int, *, seed: int = 0) -> list[str]:
    """Short sentences with a learnable order: subject, verb, place."""
    generator = random.Random(seed)
    return [
        f"the {generator.choice(WORDS[2:5])} {generator.choice(WORDS[5:8])} {generator.choice(WORDS[8:11])} "
        f"the {generator.choice(WORDS[11:14])} and then slept"
        for _ in range(count)
    ]


def make_tiny_llm(model_dir: str | Path, text_file: str | Path, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> None:
    """Write the model folder (config, weights, tokenizer) to ``model_dir`` and the text to ``text_file``."""
    import logging

    # Notices nothing here acts on: torchao's enums (imported by transformers) and the one-file save's progress bar.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()

    lines = sentences(400, seed=seed)
    # Four sentences a document, documents apart by a blank line (a .txt corpus's paragraphs).
    Path(text_file).write_text("\n\n".join(" ".join(lines[i:i + 4]) for i in range(0, len(lines), 4)) + "\n")
    words = Tokenizer(models.WordLevel(unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["<pad>", "<eos>", "<unk>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="folder for config.json, the weights and the tokenizer (made if missing)")
    parser.add_argument("text_file", help="text to fine-tune on (.txt, one document per paragraph)")
    args = parser.parse_args(argv)
    make_tiny_llm(args.model_dir, args.text_file)
    print(f"wrote {args.model_dir} (config.json, weights, tokenizer) and {args.text_file}")


if __name__ == "__main__":
    main()
