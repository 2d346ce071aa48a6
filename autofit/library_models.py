"""Models named by library: ``timm:NAME`` and ``hf:PATH`` (transformers), built from configs, never downloaded.

transformers and timm are optional (``pip install 'autofit[hf]'``); naming
such a model without the library installed is one line saying what to install.

``hf:PATH`` is a local directory holding a transformers ``config.json`` (or
the file itself). The model is built with ``AutoModelFor<Task>.from_config``:
random weights, no hub access. Tasks:

- ``causal-lm``: inputs ``{"input_ids", "attention_mask", "labels"}``, no
  targets; the model computes its own loss, and micro-batches are weighted by
  the labels it predicts (``count_labels(shift=True)``), so accumulation is exact.
- ``sequence-classification``: inputs ``{"input_ids", "attention_mask"}``,
  targets the class labels; cross-entropy of ``.logits``.
- ``image-classification``: inputs images (B, C, H, W) from the config's
  ``num_channels`` and ``image_size`` (so an image folder trains it), targets labels.

Without ``--data``, text tasks train on synthetic random tokens (for a smoke
run); ``autofit train --data corpus.jsonl`` trains a causal LM on text
(``autofit.training.text``), and ``autofit.fit`` takes your own datasets.
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from autofit.errors import UserError, one_line
from autofit.model_io import Loss, count_labels

HF_TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "image-classification": "AutoModelForImageClassification",
}
"""--task -> the transformers auto class that builds it."""

_ARCHITECTURE_TASKS = (
    ("ForCausalLM", "causal-lm"),
    ("LMHeadModel", "causal-lm"),
    ("ForSequenceClassification", "sequence-classification"),
    ("ForImageClassification", "image-classification"),
)
DEFAULT_SEQ_LEN = 128
"""Tokens per example sequence when neither --seq-len nor a shorter context length says otherwise."""
SYNTHETIC_SAMPLES = (256, 64)
"""Train and val samples of the synthetic token datasets (smoke runs of text tasks without data)."""


def require(package: str, *, source: str):
    """Import an optional library, or fail with one line saying what to install."""
    try:
        return importlib.import_module(package)
    except ImportError as error:
        raise UserError(
            f"{source} needs the {package} package, which is not installed; pip install 'autofit[hf]' "
            f"(or pip install {package})"
        ) from error


# ---- timm ---------------------------------------------------------------------------------------

def timm_parts(source: str, *, input_shape: tuple[int, ...], num_classes: int | None) -> dict:
    """``timm:NAME``: ``timm.create_model(NAME, pretrained=False)`` for (C, H, W) images and ``num_classes`` outputs.

    Returns the ``ModelSpec`` fields besides ``source`` and ``build_optimizer`` (``spec.load_spec`` adds them).
    """
    timm = require("timm", source=source)
    name = source.split(":", 1)[1]
    num_classes = 1000 if num_classes is None else num_classes  # load_spec refused fewer than 2
    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('_')[0]}*")[:6]
        raise UserError(f"timm model {name!r} is unknown; try e.g. timm:resnet18 (similar names: {', '.join(close) or 'none'})")
    if len(input_shape) != 3:
        raise UserError(f"--input-shape {'x'.join(map(str, input_shape))} must be CxHxW for a timm model")
    channels, height, width = input_shape
    options = {"pretrained": False, "num_classes": num_classes, "in_chans": channels}
    # Vision transformers fix their patch grid at construction: tell them the image size.
    with torch.device("meta"):
        try:
            timm.create_model(name, img_size=(height, width), **options)
            options["img_size"] = (height, width)
        except TypeError:  # a model without img_size (CNNs take any size)
            pass

    def build_model() -> nn.Module:
        return timm.create_model(name, **options)

    def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch_size, *input_shape), torch.randint(0, num_classes, (batch_size,))

    return dict(
        build_model=build_model, example_batch=example_batch, loss_fn=Loss(nn.functional.cross_entropy),
        input_shape=tuple(input_shape), source_options={"num_classes": num_classes},
    )


# ---- transformers ---------------------------------------------------------------------------------

def hf_parts(source: str, *, task: str | None, seq_len: int | None, num_classes: int | None, input_shape: str | None = None) -> dict:
    """``hf:PATH``: a transformers model built from a local config (see the module docstring).

    Returns the ``ModelSpec`` fields besides ``source`` and ``build_optimizer`` (``spec.load_spec`` adds them).

    Raises:
        UserError: transformers is missing, the path holds no config.json, the
            task is unknown or cannot be inferred, or the sequence is too long.
    """
    transformers = require("transformers", source=source)
    config = _hf_config(transformers, source)
    task = task or _task_from(config, source)
    if task not in HF_TASKS:
        raise UserError(f"--task {task!r} is unknown for {source}; choose {', '.join(HF_TASKS)}")
    if task != "causal-lm":
        if num_classes is not None:  # at least 2: load_spec refused fewer
            config.num_labels = num_classes
        num_classes = config.num_labels
    auto_class = getattr(transformers, HF_TASKS[task])
    _check_hf_config(transformers, config, task=task, source=source)
    if hasattr(config, "use_cache"):
        config.use_cache = False  # training keeps no key/value cache (and checkpointed blocks recompute without one)
    built = dict(build_model=_hf_builder(auto_class, config, source=source), **_hf_loading(transformers, auto_class, config, source=source))
    if task == "image-classification":
        return {**_hf_image_parts(config, num_classes=num_classes), **built}
    return {**_hf_text_parts(config, task=task, seq_len=seq_len, num_classes=num_classes), **built}


def _hf_builder(auto_class, config, *, source: str):
    def build_model() -> nn.Module:
        try:
            return auto_class.from_config(config, dtype=torch.float32)  # fp32 weights whatever the config's dtype: the plan's precision is the declared choice
        except ValueError as error:  # transformers checks the config as it builds (e.g. a width its heads do not divide)
            raise UserError(f"{source}: transformers cannot build a model from config.json ({one_line(str(error))[:200]}); fix config.json") from error

    return build_model


def _hf_loading(transformers, auto_class, config, *, source: str) -> dict:
    """The spec's fields about weights: how pretrained ones load (where the folder has them), and the config's dtype."""
    weights = pretrained_weights(source)
    if weights is not None:
        def build_pretrained() -> nn.Module:
            return _from_pretrained(transformers, auto_class, config=config, weights=weights, source=source)

        loading = dict(build_pretrained=build_pretrained, weights_note=f"pretrained from {weights.parent}")
    else:
        loading = dict(weights_note=f"random init from {hf_config_file(source).name}")
    loading["config_dtype"] = _config_dtype(config)  # said with the plan's precision (``spec.weights_held``), never silently trained in
    return loading


def _hf_image_parts(config, *, num_classes: int) -> dict:
    """An image classifier's example batches and loss, at its config's image size."""
    size = getattr(config, "image_size", 224)
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    shape = (getattr(config, "num_channels", 3), height, width)

    def example_batch(batch_size: int):
        return torch.randn(batch_size, *shape), torch.randint(0, num_classes, (batch_size,))

    return dict(
        example_batch=example_batch, loss_fn=Loss(None), input_shape=shape,
        source_options={"task": "image-classification", "num_classes": num_classes},
    )


def _hf_text_parts(config, *, task: str, seq_len: int | None, num_classes: int | None) -> dict:
    """A language model's or text classifier's example batches, loss and synthetic data, at its sequence length.

    Raises:
        UserError: the sequence is shorter than 2 tokens or longer than the model's context.
    """
    vocab_size = config.vocab_size
    longest = _context_length(config)
    seq_len = min(DEFAULT_SEQ_LEN, longest or DEFAULT_SEQ_LEN) if seq_len is None else seq_len  # 0 is refused below
    if seq_len < 2 or (longest and seq_len > longest):
        raise UserError(f"--seq-len {seq_len} must be between 2 and the model's context length {longest or 'unknown'}")
    options: dict = {"task": task, "seq_len": seq_len}
    if task == "causal-lm":
        def example_batch(batch_size: int):
            return causal_lm_batch(torch.randint(0, vocab_size, (batch_size, seq_len))), None

        loss = Loss(None, count_items=count_labels(shift=True))
        datasets = {part: (lambda part=part: SyntheticTokens(
            vocab_size=vocab_size, seq_len=seq_len, samples=SYNTHETIC_SAMPLES[part == "val"], seed=part == "val"))
            for part in ("train", "val")}
    else:
        options["num_classes"] = num_classes

        def example_batch(batch_size: int):
            tokens = torch.randint(0, vocab_size, (batch_size, seq_len))
            return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}, torch.randint(0, num_classes, (batch_size,))

        loss = Loss(None)  # cross-entropy of .logits (no labels in the inputs, so no own loss)
        datasets = {part: (lambda part=part: SyntheticTokens(
            vocab_size=vocab_size, seq_len=seq_len, samples=SYNTHETIC_SAMPLES[part == "val"], seed=part == "val",
            num_classes=num_classes)) for part in ("train", "val")}
    return dict(
        example_batch=example_batch, loss_fn=loss, train_dataset=datasets["train"], val_dataset=datasets["val"], source_options=options,
        context_length=longest,
    )


def _config_dtype(config) -> str | None:
    """config.json's ``dtype`` in a precision's spelling ("fp32", "bf16", "fp16"; another dtype by its torch name);
    None where it names none."""
    saved = getattr(config, "dtype", None)
    if saved is None:
        return None
    name = str(saved).removeprefix("torch.")
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name)


def _check_hf_config(transformers, config, *, task: str, source: str) -> None:
    """What transformers would refuse only once the model runs, refused now in one line.

    Raises:
        UserError: the model type has no head for ``task`` in transformers, a layer count below 1, the vocabulary is empty, or sequence
            classification has no pad token (transformers needs one for batches of more than one sequence).
    """
    if type(config) not in getattr(transformers, HF_TASKS[task])._model_mapping:
        tasks = [t for t, name in HF_TASKS.items() if type(config) in getattr(transformers, name)._model_mapping]
        raise UserError(
            f"{source}: transformers has no {task} model for model_type {config.model_type!r} ({HF_TASKS[task]}); "
            + (f"give --task {' or '.join(tasks)}" if tasks else "give a config of another model type")
        )
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        layers = getattr(config, name, None)
        if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
            # transformers builds a model of no layers from -1 or 0 without a word
            raise UserError(f"{source}: config.json's {name} {layers!r} must be a whole number of at least 1 layer")
    vocab_size = getattr(config, "vocab_size", None)
    if task != "image-classification" and (not isinstance(vocab_size, int) or vocab_size < 2):
        raise UserError(f"{source}: config.json's vocab_size {vocab_size!r} must be a whole number of at least 2 tokens")
    if task == "sequence-classification" and getattr(config, "pad_token_id", None) is None:
        eos = getattr(config, "eos_token_id", None)
        raise UserError(
            f"{source}: config.json has no pad_token_id, which transformers' sequence classification needs to find each "
            f"sequence's last token; set pad_token_id in config.json" + (f" (e.g. to its eos_token_id, {eos})" if eos is not None else "")
        )


def causal_lm_batch(tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A causal-LM batch for transformers: the tokens are their own labels; padding (mask 0) is labelled -100."""
    mask = torch.ones_like(tokens) if attention_mask is None else attention_mask
    return {"input_ids": tokens, "attention_mask": mask, "labels": tokens.masked_fill(mask == 0, -100)}


class SyntheticTokens(torch.utils.data.Dataset):
    """Random token sequences with a learnable pattern (each token follows from the one before), for smoke runs.

    Samples are dicts (causal LM: the model's inputs, labels included) or
    (dict, class) pairs (sequence classification: the class is the first token's bucket).
    """

    description = "synthetic tokens, for a smoke run"

    def __init__(self, *, vocab_size: int, seq_len: int, samples: int, seed: int, num_classes: int | None = None) -> None:
        generator = torch.Generator().manual_seed(1234 + int(seed))
        start = torch.randint(0, vocab_size, (samples, 1), generator=generator)
        step = torch.randint(1, 4, (samples, 1), generator=generator)
        self.tokens = (start + step * torch.arange(seq_len)) % vocab_size  # (N, T)
        self.num_classes = num_classes
        if num_classes is not None:
            self.labels = start[:, 0] * num_classes // vocab_size
            self.classes = [str(c) for c in range(num_classes)]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int):
        tokens = self.tokens[index]
        if self.num_classes is None:
            return causal_lm_batch(tokens)
        return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}, self.labels[index]


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
"""What ``save_pretrained`` writes, in the order transformers prefers them: one file, or shards and their index."""


def pretrained_weights(source: str) -> Path | None:
    """The weights file (or shards' index) beside an ``hf:`` source's config; None when it has none."""
    folder = hf_dir(source)
    return next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)


def _from_pretrained(transformers, auto_class, *, config, weights: Path, source: str) -> nn.Module:
    """The model with the weights in ``weights.parent`` (local files only), in fp32 whatever they were saved in.

    transformers builds it on the meta device and assigns the loaded tensors (no second copy in memory). A head
    the checkpoint lacks (a classifier on a language model's weights) starts from random weights, as
    transformers does; any other key missing, or a shape that differs, is one line naming the file.
    """
    try:
        with quiet_transformers():  # its load report and progress bars: autofit says what it loaded
            model, info = auto_class.from_pretrained(
                str(weights.parent), config=config, local_files_only=True, dtype=torch.float32, ignore_mismatched_sizes=True,
                output_loading_info=True,
            )
    except Exception as error:  # an unreadable or foreign file: the user's to replace
        raise UserError(f"{source}: cannot load the weights in {str(weights)!r} ({type(error).__name__}: {str(error).splitlines()[0][:200]}); "
                        "give --from-config to train from random weights") from error
    prefix = getattr(model, "base_model_prefix", "") + "."
    missing = sorted(key for key in info["missing_keys"] if key.startswith(prefix))
    mismatched = sorted(info["mismatched_keys"])
    if mismatched:
        key, saved, built = mismatched[0]
        raise UserError(
            f"{source}: the weights in {str(weights)!r} do not fit the config: {key} is {tuple(saved)} in the file but "
            f"{tuple(built)} in the model ({len(mismatched)} such); give the config they were saved with, or --from-config"
        )
    if missing:
        raise UserError(
            f"{source}: the weights in {str(weights)!r} lack {len(missing)} of the model's tensors (e.g. {', '.join(missing[:3])}); "
            "give the weights saved with this config, or --from-config to train from random weights"
        )
    return model


@contextmanager
def quiet_transformers():
    """transformers without its progress bars and reports (errors still raise), put back after."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def hf_config_file(source: str) -> Path:
    """The config.json an ``hf:`` source names: DIR/config.json, or the file itself."""
    path = Path(source.split(":", 1)[1]).expanduser()
    return path / "config.json" if path.is_dir() else path


def hf_dir(source: str) -> Path:
    """The directory of an ``hf:`` source: where its config, weights and tokenizer lie."""
    return hf_config_file(source).parent


def _hf_config(transformers, source: str):
    file = hf_config_file(source)
    if not file.is_file():
        raise UserError(
            f"{source}: no transformers config at {str(file)!r}; give a local directory holding config.json "
            "(e.g. from config.save_pretrained(DIR)) or the config.json itself (nothing is downloaded)"
        )
    try:
        return transformers.AutoConfig.from_pretrained(str(file.parent if file.name == "config.json" else file), local_files_only=True)
    except Exception as error:  # a malformed or foreign config: the user's file to fix
        raise UserError(f"{source}: {str(file)!r} is not a transformers config ({type(error).__name__}: {str(error).splitlines()[0][:160]})") from error


def _task_from(config, source: str) -> str:
    for architecture in getattr(config, "architectures", None) or []:
        for suffix, task in _ARCHITECTURE_TASKS:
            if architecture.endswith(suffix):
                return task
    raise UserError(f"{source}: say what to train it for with --task {'|'.join(HF_TASKS)} (its config names no architecture)")


def _context_length(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
