"""Text data from the CLI: .txt/.jsonl/.parquet/datasets folders, tokenized with hf:DIR's tokenizer, packed or padded."""
import json

import pytest
import torch

from autofit.errors import UserError
from autofit.model_io import Loss, count_labels
from tests.helpers.tiny_lm import corpus_lines

pytest.importorskip("transformers")


def _tokenizer(tiny_lm):
    from autofit.training.text import load_tokenizer

    return load_tokenizer(tiny_lm)


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_plan_then_train_on_jsonl_reports_falling_perplexity(tiny_lm, tmp_path, run_cli):
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [{"text": line} for line in corpus_lines(160)])
    plan = tmp_path / "plan.json"
    code, out, err = run_cli("plan", f"hf:{tiny_lm}", "--task", "causal-lm", "--seq-len", "32", "--batch-size", "4",
                             "--budget", "1GB", "--out", plan, "--precisions", "fp32")
    assert code == 0, err
    code, out, err = run_cli("train", "--plan", plan, "--data", corpus, "--epochs", "2", "--workers", "0",
                             "--log-dir", tmp_path / "run", "--lr", "3e-3")
    assert code == 0, err
    epochs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epochs = [record for record in epochs if record["kind"] == "epoch"]
    assert len(epochs) == 2
    assert all(record["val_perplexity"] is not None for record in epochs)
    assert epochs[1]["val_perplexity"] < epochs[0]["val_perplexity"]
    assert epochs[0]["val_perplexity"] == pytest.approx(torch.tensor(epochs[0]["val_loss"]).exp().item(), rel=1e-6)
    assert "packed blocks of 32 tokens" in out


def test_packing_gives_blocks_of_exactly_seq_len_with_eos_between_documents(tiny_lm, tmp_path):
    from autofit.training.text import text_datasets

    tokenizer = _tokenizer(tiny_lm)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(corpus_lines(30)) + "\n")
    train, val = text_datasets(corpus, tokenizer=tokenizer, seq_len=16, val_fraction=0.1)
    total = sum(len(tokenizer(line, add_special_tokens=False)["input_ids"]) + 1 for line in corpus_lines(30))
    assert len(train) + len(val) == total // 16 and len(val) == round(total // 16 * 0.1)
    assert train.input_ids.shape[1] == 16 and bool((train.attention_mask == 1).all())
    assert torch.equal(train.labels, train.input_ids)
    first_line = tokenizer(corpus_lines(30)[0], add_special_tokens=False)["input_ids"]
    assert train.input_ids.flatten()[len(first_line)].item() == tokenizer.eos_token_id


def test_prompt_tokens_are_labelled_minus_100_and_not_counted(tiny_lm, tmp_path):
    from autofit.training.text import text_datasets

    tokenizer = _tokenizer(tiny_lm)
    corpus = _write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": "the cat sat on", "completion": "the mat"}, {"prompt": "the dog", "completion": "ran under the log and then slept"},
    ])
    train, val = text_datasets(corpus, tokenizer=tokenizer, seq_len=12, pack=False, val_fraction=0.0)
    assert val is None and len(train) == 2
    first = train[0]
    ids = tokenizer("the cat sat on the mat", add_special_tokens=False)["input_ids"]
    assert first["input_ids"][:7].tolist() == ids + [tokenizer.eos_token_id]
    assert first["labels"].tolist() == [-100] * 4 + ids[4:] + [tokenizer.eos_token_id] + [-100] * 5
    assert first["attention_mask"].tolist() == [1] * 7 + [0] * 5
    assert first["input_ids"][7:].tolist() == [tokenizer.pad_token_id] * 5
    batch = {key: torch.stack([train[0][key], train[1][key]]) for key in first}
    # count_items (shifted, as the causal LM predicts) counts completion and EOS tokens only.
    assert count_labels(shift=True)(batch, None) == 3 + 8


def test_accumulation_2x2_equals_1x4_token_weighted(tiny_lm, tmp_path):
    from transformers import AutoModelForCausalLM

    from autofit.config import TrainingConfig
    from autofit.apply import apply_config
    from autofit.step import train_step
    from autofit.training.text import text_datasets

    corpus = _write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": " ".join(line.split()[:k]), "completion": " ".join(line.split()[k:])}
        for k, line in zip([1, 6, 3, 8], corpus_lines(4))
    ])
    train, _ = text_datasets(corpus, tokenizer=_tokenizer(tiny_lm), seq_len=16, pack=False, val_fraction=0.0)
    batch = {key: torch.stack([train[i][key] for i in range(4)]) for key in train[0]}
    assert len({count_labels(shift=True)({"labels": batch["labels"][i:i + 2]}, None) for i in (0, 2)}) == 2  # unequal halves
    grads = {}
    for micro in (4, 2):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_lm, local_files_only=True)
        config = TrainingConfig(global_batch_size=4, micro_batch_size=micro)
        applied = apply_config(model, config, device="cpu")
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        seen = {}
        hook = optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.update(
            {name: p.grad.clone() for name, p in model.named_parameters()}))
        result = train_step(applied, batch, None, loss_fn=Loss(None, count_items=count_labels(shift=True)), optimizer=optimizer)
        hook.remove()
        grads[micro] = (result.loss.item(), seen)
    assert grads[2][0] == pytest.approx(grads[4][0], rel=1e-5)
    for name, grad in grads[4][1].items():
        torch.testing.assert_close(grads[2][1][name], grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("content, message", [
    ("", "is empty"),
    ('{"text": "the cat"}\nnot json\n', "line 2 is not JSON"),
    ('{"body": "the cat"}\n', "no 'text' field"),
    ('{"text": "the cat"}\n', "fewer than one block"),
])
@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_bad_text_is_one_line(tiny_lm, tmp_path, run_cli, content, message):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(content)
    plan = tmp_path / "plan.json"
    _plan(run_cli, tiny_lm, plan)
    code, out, err = run_cli("train", "--plan", plan, "--data", corpus, "--workers", "0", "--log-dir", tmp_path / "run")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow  # plans, probes or trains: seconds to tens of seconds
def test_a_model_without_tokenizer_is_one_line(tmp_path, run_cli):
    from tests.helpers.tiny_lm import tiny_lm_dir

    model_dir = tiny_lm_dir(tmp_path / "bare", tokenizer=False)
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [{"text": line} for line in corpus_lines(20)])
    plan = tmp_path / "plan.json"
    _plan(run_cli, model_dir, plan)
    code, out, err = run_cli("train", "--plan", plan, "--data", corpus, "--workers", "0", "--log-dir", tmp_path / "run")
    assert code == 2 and "holds no tokenizer" in err and len(err.strip().splitlines()) == 1, err


def test_parquet_and_datasets_folder(tiny_lm, tmp_path):
    datasets = pytest.importorskip("datasets")
    from autofit.training.data import cli_data
    from autofit.spec import load_spec

    spec = load_spec(f"hf:{tiny_lm / 'config.json'}", task="causal-lm", seq_len=16)  # the config file names its folder
    table = datasets.Dataset.from_dict({"text": corpus_lines(20)})
    table.to_parquet(str(tmp_path / "corpus.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    read = {name: cli_data(tmp_path / name, spec=spec, input_shape=None, seq_len=16) for name in ("corpus.parquet", "saved")}
    assert torch.equal(read["corpus.parquet"].train.input_ids, read["saved"].train.input_ids)
    assert read["saved"].val is not None and len(read["saved"].val) >= 1


def _plan(run_cli, model_dir, plan):
    code, out, err = run_cli("plan", f"hf:{model_dir}", "--task", "causal-lm", "--seq-len", "16", "--batch-size", "4",
                             "--budget", "1GB", "--out", plan, "--precisions", "fp32", "--simulate")
    assert code == 0, err


def test_a_file_that_is_not_text_is_one_line_for_a_language_model(tiny_lm, tmp_path, run_cli):
    plan = tmp_path / "plan.json"
    _plan(run_cli, tiny_lm, plan)
    (tmp_path / "notes.md").write_text("the cat\n")
    code, out, err = run_cli("train", "--plan", plan, "--data", tmp_path / "notes.md", "--workers", "0", "--log-dir", tmp_path / "run")
    assert code == 2 and "is not text this language model can read" in err and len(err.strip().splitlines()) == 1, err


def test_resume_reads_text_as_the_run_began(tiny_lm, tmp_path, run_cli):
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [{"text": line} for line in corpus_lines(40)])
    plan = tmp_path / "plan.json"
    _plan(run_cli, tiny_lm, plan)
    run = tmp_path / "run"
    code, out, err = run_cli("train", "--plan", plan, "--data", corpus, "--no-pack", "--val-fraction", "0.1", "--workers", "0",
                             "--log-dir", run, "--max-steps", "2")
    assert code == 0, err
    code, out, err = run_cli("train", "--log-dir", run, "--resume", "--pack", "--workers", "0")
    assert code == 2 and "--pack True differs" in err, err
    code, out, err = run_cli("train", "--log-dir", run, "--resume", "--workers", "0")
    assert code == 0, err
    assert "36 padded samples of 16 tokens; 4 held out" in out


def test_a_tokenizer_larger_than_the_vocabulary_is_one_line(tiny_lm, tmp_path):
    from autofit.training.text import text_datasets

    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [{"text": line} for line in corpus_lines(20)])
    with pytest.raises(UserError, match="tokenizer has 19 tokens but the model's vocabulary holds 8"):
        text_datasets(corpus, tokenizer=_tokenizer(tiny_lm), seq_len=16, vocab_size=8)


def _hand_plan(tmp_path, model_dir, *, seq_len: int = 16) -> str:
    """A plan for hf:model_dir written by hand (batch 4 in one micro-batch, fp32): nothing planned or measured."""
    from autofit.config import TrainingConfig
    from autofit.plan_file import DeviceInfo, ModelInfo, Plan, save_plan
    from autofit.spec import load_spec, model_fingerprint

    source = f"hf:{model_dir}"
    spec = load_spec(source, task="causal-lm", seq_len=seq_len)
    plan = Plan(
        model=ModelInfo(source=source, fingerprint=model_fingerprint(spec.build_model()), task="causal-lm", seq_len=seq_len),
        device=DeviceInfo(type="cpu"), budget_bytes=10**9, config=TrainingConfig(global_batch_size=4, micro_batch_size=4),
    )
    return str(save_plan(plan, tmp_path / "plan.json"))


LONG_PROMPT = "the cat sat on the mat and then slept the dog ran under the log and then slept quickly"
"""19 tokens: longer than a --seq-len 16 sample, so a padded sample holds none of its completion."""


@pytest.mark.parametrize("records, pack, said", [
    ([{"prompt": LONG_PROMPT, "completion": "the mat"}] * 8, False,
     "every completion is empty or cut off by --seq-len 16 (prompts of up to 19 tokens); plan again with a --seq-len above 19"),
    ([{"prompt": "the cat sat", "completion": ""}] * 8, True, "every completion is empty"),
    ([{"text": ""}] * 40, True, "every text is empty"),
    ([{"text": ""}] * 8, False, "every text is empty"),
], ids=["prompts-cut-off-padded", "completions-empty-packed", "texts-empty-packed", "texts-empty-padded"])
def test_a_corpus_with_no_token_to_learn_is_refused_saying_why(tiny_lm, tmp_path, records, pack, said):
    """Every label -100 (or only the EOS between documents): the loss would be 0 at each step and nothing learned."""
    from autofit.training.text import text_datasets

    corpus = _write_jsonl(tmp_path / "corpus.jsonl", records)
    with pytest.raises(UserError, match="no token to learn") as error:
        text_datasets(corpus, tokenizer=_tokenizer(tiny_lm), seq_len=16, pack=pack, val_fraction=0.0)
    assert str(error.value).startswith(f"{corpus}: no token to learn: ") and said in str(error.value), error.value
    # Packed, the same long prompts leave their completions whole: that corpus trains.
    if records[0].get("completion"):
        train, _ = text_datasets(corpus, tokenizer=_tokenizer(tiny_lm), seq_len=16, pack=True, val_fraction=0.0)
        assert len(train) > 0


def test_train_refuses_a_corpus_with_no_token_to_learn_before_its_first_step(tiny_lm, tmp_path, run_cli):
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [{"prompt": LONG_PROMPT, "completion": "the mat"}] * 8)
    run = tmp_path / "run"
    code, out, err = run_cli("train", "--plan", _hand_plan(tmp_path, tiny_lm), "--data", corpus, "--no-pack",
                             "--workers", "0", "--log-dir", run, "--max-steps", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{corpus}: no token to learn: every completion is empty or cut off by --seq-len 16" in err
    assert not run.exists() or not any(run.iterdir())


def test_a_run_whose_weights_diverge_writes_no_hf_nor_best_pt(tiny_lm, tmp_path, run_cli):
    """--lr 1e308: step 1's update leaves the weights inf/nan; the run ends in one line, exit 2, and hf/ and best.pt
    are not written from them."""
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [{"text": line} for line in corpus_lines(20)])
    run = tmp_path / "run"
    code, out, err = run_cli("train", "--plan", _hand_plan(tmp_path, tiny_lm), "--data", corpus, "--workers", "0",
                             "--log-dir", run, "--max-steps", "1", "--lr", "1e308")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "training diverged: the weights are no longer finite (step 1's update made them so)" in err
    assert "try a --lr below 1e+308" in err
    assert not any((run / name).exists() for name in ("hf", "best.pt", "last.pt"))
