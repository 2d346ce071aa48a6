"""Text data for a causal language model: read documents, tokenize them, pack (or pad) them to the plan's sequence length.

Sources (``text_data``):

- ``.txt``: one document per paragraph (paragraphs are separated by a blank line).
- ``.jsonl``: one JSON object per line with a ``text`` field, or ``prompt`` and
  ``completion`` fields; for the latter the loss is on the completion only
  (the prompt's labels are -100).
- ``.parquet``: a ``text`` column (or ``prompt``/``completion`` columns).
- a folder written by 🤗 datasets' ``save_to_disk`` (read with ``load_from_disk``;
  a ``DatasetDict`` gives its ``train`` split).

Samples are the model's inputs with their labels (``input_ids``, ``attention_mask``,
``labels``). Packed (the default): every document is tokenized, followed by the
EOS token, all are concatenated and cut into blocks of exactly ``seq_len``
tokens (the tail shorter than a block is dropped). Padded (``pack=False``):
one document per sample, cut to ``seq_len`` and padded with the pad token,
attention mask 0 and label -100 on the padding. Labels of -100 are neither
in the loss nor counted by ``count_labels``, so accumulation stays exact.

The validation split is the last ``val_fraction`` of the samples (at least one).
Training samples that hold no token to learn (every completion empty or cut
off at ``seq_len``, every text empty) are refused before the first step:
their loss is 0 at every step and the weights learn nothing.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from autofit.errors import UserError, one_line
from autofit.model_io import IGNORE_INDEX

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
"""File suffixes read as text; a folder is text when datasets saved it (dataset_info.json or dataset_dict.json)."""
DEFAULT_VAL_FRACTION = 0.05


def is_text_source(path: Path) -> bool:
    """True for a .txt, .jsonl or .parquet file, or a folder saved by 🤗 datasets."""
    path = Path(path)
    if path.suffix.lower() in TEXT_SUFFIXES:
        return True
    return path.is_dir() and any((path / name).is_file() for name in ("dataset_info.json", "dataset_dict.json", "state.json"))


def read_documents(path: str | Path) -> list[dict]:
    """The documents of a text source: each ``{"text": str}`` or ``{"prompt": str, "completion": str}``.

    Raises:
        UserError: the file is missing or empty, a .jsonl line is not JSON (its
            number named), a record has no ``text`` (nor ``prompt``/``completion``), or
            reading .parquet or a datasets folder needs the ``datasets`` package.
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"text data {str(path)!r} does not exist; give a .txt, .jsonl or .parquet file or a datasets folder")
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES and path.is_dir():
        raise UserError(f"text data {str(path)!r} is a folder, not a {suffix} file; give the file itself, or a folder saved by datasets' save_to_disk")
    if not path.is_file() and not path.is_dir():  # a pipe would block open() until a writer came, a device never end
        raise UserError(f"text data {str(path)!r} is not a regular file (a pipe, socket or device); save the text to a file and give that")
    if suffix == ".txt":
        text = _utf8_text(path)
        documents = [{"text": part.strip()} for part in text.split("\n\n") if part.strip()]
    elif suffix == ".jsonl":
        documents = []
        for number, line in enumerate(_utf8_text(path).splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise UserError(f"{path}: line {number} is not JSON ({error.msg}); give one JSON object per line") from None
            documents.append(_document(record, where=f"{path}: line {number}"))
    else:
        rows = _datasets_rows(path)
        documents = [_document(row, where=f"{path}: row {index}") for index, row in enumerate(rows)]
    if not documents:
        raise UserError(f"text data {str(path)!r} is empty; give at least one document")
    return documents


def _utf8_text(path: Path) -> str:
    """The file's text, read as UTF-8 with or without a byte-order mark (``utf-8-sig``).

    Raises:
        UserError: the file is not UTF-8 (naming where, and how to convert it).
    """
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise UserError(
            f"text data {str(path)!r} is not UTF-8 (byte 0x{error.object[error.start]:02x} at offset {error.start}); "
            f"convert it, e.g. `iconv -f latin1 -t utf-8 {path} > utf8{path.suffix}`, and give that file"
        ) from None


def _document(record, *, where: str) -> dict:
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return {"text": record["text"]}
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return {"prompt": record["prompt"], "completion": record["completion"]}
    fields = ", ".join(record) if isinstance(record, dict) else type(record).__name__
    raise UserError(f"{where} has no 'text' field (nor 'prompt' and 'completion'; it has: {fields or 'nothing'}); give text as a string")


def _datasets_rows(path: Path):
    try:
        import datasets
    except ImportError:
        raise UserError(f"reading {str(path)!r} needs the datasets package; pip install 'autofit[text]' (or pip install datasets)") from None
    if path.suffix.lower() == ".parquet":
        try:
            with _quiet_datasets(datasets):
                return datasets.Dataset.from_parquet(str(path))
        except Exception as error:  # pyarrow's ArrowInvalid, datasets' DatasetGenerationError around it: the file is bad
            raise UserError(
                f"{str(path)!r} cannot be read as parquet ({type(error).__name__}: {one_line(str(error))[:160]}); "
                "is it truncated or another format? Write it again (e.g. DataFrame.to_parquet) or give a .jsonl"
            ) from None
    try:
        with _quiet_datasets(datasets):
            loaded = datasets.load_from_disk(str(path))
    except Exception as error:  # not a datasets folder: the user's data to fix
        raise UserError(f"{str(path)!r} is not a folder saved by datasets' save_to_disk ({type(error).__name__}: {str(error)[:160]})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise UserError(f"{str(path)!r} holds the splits {', '.join(loaded)} but no 'train'; save the split to train on as 'train'")
        loaded = loaded["train"]
    return loaded


@contextmanager
def _quiet_datasets(datasets):
    """datasets' progress bars ("Generating train split", "Loading dataset from disk") and its log ("Failed to read
    schema ..." above the line a bad file gets) left out: the run prints its own lines; both are put back after."""
    import logging

    bars = not datasets.are_progress_bars_disabled()
    logger = logging.getLogger("datasets")
    level = logger.level
    datasets.disable_progress_bars()
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def load_tokenizer(model_dir: str | Path):
    """The tokenizer saved beside an ``hf:DIR`` model (``AutoTokenizer``, local files only).

    Raises:
        UserError: DIR holds no tokenizer, or it has no EOS token.
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as error:
        raise UserError(
            f"hf:{model_dir} holds no tokenizer to read text data with ({type(error).__name__}); save one there "
            "(tokenizer.save_pretrained(DIR)), or train on the model file's datasets"
        ) from None
    if tokenizer.eos_token_id is None:
        raise UserError(f"the tokenizer in {model_dir} has no EOS token to separate documents; set tokenizer.eos_token and save it again")
    return tokenizer


def tokenize(documents: list[dict], tokenizer) -> list[tuple[list[int], list[int]]]:
    """(token ids, labels) per document: labels are the ids, -100 on a prompt's tokens.

    Every string is encoded in one batched call (a fast tokenizer spreads it over threads).
    """
    strings = [part for document in documents for part in ((document["text"],) if "text" in document else (document["prompt"], document["completion"]))]
    ids = iter(tokenizer(strings, add_special_tokens=False)["input_ids"]) if strings else iter(())
    encoded = []
    for document in documents:
        if "text" in document:
            text_ids = list(next(ids))
            encoded.append((text_ids, list(text_ids)))
        else:
            prompt, completion = list(next(ids)), list(next(ids))
            encoded.append((prompt + completion, [IGNORE_INDEX] * len(prompt) + completion))
    return encoded


class TokenBlocks(torch.utils.data.Dataset):
    """Causal-LM samples: (N, T) input ids, attention masks and labels; each sample a dict of the model's inputs."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor, *, description: str) -> None:
        self.input_ids, self.attention_mask, self.labels = input_ids, attention_mask, labels
        self.description = description

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index], "labels": self.labels[index]}

    def subset(self, rows: slice, *, description: str) -> TokenBlocks:
        return TokenBlocks(self.input_ids[rows], self.attention_mask[rows], self.labels[rows], description=description)


def packed_blocks(encoded: list[tuple[list[int], list[int]]], *, seq_len: int, eos_id: int, source: str) -> TokenBlocks:
    """All documents, each followed by EOS, concatenated and cut into blocks of exactly ``seq_len`` tokens.

    Raises:
        UserError: the corpus is shorter than one block.
    """
    ids, labels = [], []
    for document_ids, document_labels in encoded:
        ids += document_ids + [eos_id]
        labels += document_labels + [eos_id]
    blocks = len(ids) // seq_len
    if blocks == 0:
        raise UserError(
            f"{source} holds {len(ids)} tokens, fewer than one block of --seq-len {seq_len}; "
            "give more text, or plan with a smaller --seq-len"
        )
    input_ids = torch.tensor(ids[: blocks * seq_len]).view(blocks, seq_len)  # (N, T)
    return TokenBlocks(
        input_ids, torch.ones_like(input_ids), torch.tensor(labels[: blocks * seq_len]).view(blocks, seq_len),
        description=f"{blocks} packed blocks of {seq_len} tokens",
    )


def padded_samples(encoded: list[tuple[list[int], list[int]]], *, seq_len: int, eos_id: int, pad_id: int) -> TokenBlocks:
    """One document per sample (its EOS appended), cut to ``seq_len``, right-padded: mask 0 and label -100 on padding."""
    count = len(encoded)
    input_ids = torch.full((count, seq_len), pad_id, dtype=torch.long)  # (N, T)
    attention_mask = torch.zeros((count, seq_len), dtype=torch.long)
    labels = torch.full((count, seq_len), IGNORE_INDEX, dtype=torch.long)
    for row, (document_ids, document_labels) in enumerate(encoded):
        ids, marks = (document_ids + [eos_id])[:seq_len], (document_labels + [eos_id])[:seq_len]
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
        labels[row, : len(marks)] = torch.tensor(marks, dtype=torch.long)
    return TokenBlocks(input_ids, attention_mask, labels, description=f"{count} padded samples of {seq_len} tokens")


def text_datasets(
    path: str | Path, *, tokenizer, seq_len: int, pack: bool = True, val_fraction: float = DEFAULT_VAL_FRACTION,
    vocab_size: int | None = None,
) -> tuple[TokenBlocks, TokenBlocks | None]:
    """Train and validation datasets of causal-LM samples read from ``path`` (see the module docstring).

    Args:
        path: a .txt, .jsonl or .parquet file, or a folder saved by datasets.
        tokenizer: a transformers tokenizer with an EOS token (``load_tokenizer``).
        seq_len: tokens per sample (the plan's).
        pack: True packs documents into blocks; False pads one document per sample.
        val_fraction: the share of samples held out (the last ones), at least one; 0 holds out none.
        vocab_size: the model's vocabulary; a tokenizer with more tokens is refused (its ids would not embed).

    Raises:
        UserError: bad data (see ``read_documents``), too little of it, a training split with no token to learn
            (``target_count``: every completion empty or cut off, every text empty), a bad ``val_fraction``, or a
            tokenizer larger than the model's vocabulary.

    Example:
        >>> train, val = text_datasets("corpus.jsonl", tokenizer=load_tokenizer("model"), seq_len=64)
    """
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise UserError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary holds {vocab_size}; "
            "save the model's own tokenizer beside it (or resize the model's embeddings to the tokenizer)"
        )
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction {val_fraction} must be from 0 up to (not including) 1, e.g. 0.05")
    documents = read_documents(path)
    encoded = tokenize(documents, tokenizer)
    eos_id = tokenizer.eos_token_id
    if pack:
        samples = packed_blocks(encoded, seq_len=seq_len, eos_id=eos_id, source=str(path))
    else:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
        samples = padded_samples(encoded, seq_len=seq_len, eos_id=eos_id, pad_id=pad_id)
    held = max(1, round(len(samples) * val_fraction)) if val_fraction > 0 else 0
    if held and len(samples) - held < 1:
        raise UserError(
            f"{path} gives {len(samples)} sample(s) of {seq_len} tokens: too few to hold out a validation split; "
            "give more text, or --val-fraction 0"
        )
    kept = len(samples) - held
    train = samples.subset(slice(0, kept), description=f"{kept} {'packed blocks' if pack else 'padded samples'} of {seq_len} tokens")
    val = samples.subset(slice(kept, None), description=f"{held} held out") if held else None
    if target_count(train.labels, eos_id=eos_id) == 0:  # its loss would be 0 (or nan) at every step, and nothing learned
        raise UserError(_nothing_to_learn_line(path, documents, encoded, seq_len=seq_len, pack=pack))
    return train, val


def target_count(labels: torch.Tensor, *, eos_id: int) -> int:
    """The tokens of the text a causal LM learns to predict in (N, T) ``labels``.

    Not counted: -100 (prompts, padding), each sample's first label (no token
    precedes it), and EOS, which only marks where a document ends.
    """
    predicted = labels[:, 1:]  # (N, T - 1): the labels the shifted loss sees
    return int(((predicted != IGNORE_INDEX) & (predicted != eos_id)).sum())


def _nothing_to_learn_line(path: str | Path, documents: list[dict], encoded: list[tuple[list[int], list[int]]], *, seq_len: int, pack: bool) -> str:
    """Why ``path`` gives no token to learn, and the way out."""
    text_tokens = sum(label != IGNORE_INDEX for _, labels in encoded for label in labels)
    if any("prompt" in document for document in documents):
        if not text_tokens:
            return f"{path}: no token to learn: every completion is empty (the loss is on the completion only); give each prompt its completion"
        longest = max(labels.count(IGNORE_INDEX) for _, labels in encoded)
        return (
            f"{path}: no token to learn: every completion is empty or cut off by --seq-len {seq_len} (prompts of up to "
            f"{longest} tokens); plan again with a --seq-len above {longest}, shorten the prompts"
            + (", or leave out --no-pack (packed, no completion is cut off)" if not pack else "")
        )
    if not text_tokens:
        return f"{path}: no token to learn: every text is empty; give documents with text"
    return (
        f"{path}: no token to learn: every text is a single token (a causal LM predicts each token from those before it); "
        "give longer texts" + (", or leave out --no-pack" if not pack else "")
    )
