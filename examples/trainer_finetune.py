"""Fine-tune a transformers causal LM with transformers' Trainer and an autofit plan (docs/integrations.md).

    autofit plan hf:models/my-llama --task causal-lm --seq-len 128 --budget 8GB --from-trainer-args args.json
    python examples/trainer_finetune.py plan.json --model models/my-llama --text corpus.txt --trainer-args args.json

``AutofitTrainer`` is the Trainer with the plan: its micro-batch and accumulation, its precision, its checkpointed
blocks and chunked loss, its optimizer levers. Everything else (logging, evaluation, checkpoints, ``save_model``) is
the Trainer's. Each line of the text file is a sample, padded to the plan's sequence length; the padding is left out
of the loss, and micro-batches are weighted by the tokens they hold, so the step is the whole batch's mean.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch


def text_samples(path: Path, tokenizer, *, seq_len: int) -> list[dict]:
    """One sample per non-empty line: its tokens, padded or cut to ``seq_len``, with -100 labels on the padding."""
    samples = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        encoded = tokenizer(line, padding="max_length", max_length=seq_len, truncation=True, return_tensors="pt")
        input_ids, attention_mask = encoded["input_ids"][0], encoded["attention_mask"][0]
        samples.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": input_ids.masked_fill(attention_mask == 0, -100)})
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="a plan.json made for the model (autofit plan hf:DIR --task causal-lm ...)")
    parser.add_argument("--model", required=True, help="the model's folder (config.json, weights, tokenizer)")
    parser.add_argument("--text", required=True, help="a text file, one sample per line")
    parser.add_argument("--trainer-args", help="the TrainingArguments JSON the plan was made from (--from-trainer-args)")
    parser.add_argument("--out", default="runs/trainer-finetune", help="where the Trainer writes (without --trainer-args)")
    parser.add_argument("--steps", type=int, default=-1, help="optimizer steps (default: one epoch)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, TrainingArguments

    import autofit
    from autofit.adapters import lora_model, parse_lora
    from autofit.integrations.transformers import AutofitTrainer

    plan = autofit.load_plan(args.plan)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # fp32 weights whatever config.json says: the plan's precision decides the arithmetic.
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if plan.model.lora:  # the plan was made with adapters: train those
        model = lora_model(model, parse_lora(plan.model.lora))
    if args.trainer_args:
        (training_args,) = HfArgumentParser(TrainingArguments).parse_json_file(args.trainer_args)
    else:
        training_args = TrainingArguments(args.out, num_train_epochs=1, learning_rate=5e-5, report_to=[], save_strategy="no")
    if args.steps > 0:
        training_args.max_steps = args.steps
    dataset = text_samples(args.text, tokenizer, seq_len=plan.model.seq_len or 128)
    trainer = AutofitTrainer(model=model, args=training_args, train_dataset=dataset, plan=plan, processing_class=tokenizer)
    result = trainer.train()
    trainer.save_model(Path(trainer.args.output_dir) / "final")
    config = plan.config
    print(f"trained {result.global_step} step(s) of {config.global_batch_size} samples ({config.micro_batch_size} x "
          f"{config.grad_accum_steps}): loss {result.training_loss:.4f}; saved to {Path(trainer.args.output_dir) / 'final'}")


if __name__ == "__main__":
    main()
