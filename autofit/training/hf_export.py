"""``hf/`` in a run directory: the trained model in transformers' ``save_pretrained`` format.

For a transformers model (an ``hf:`` model, or one passed to ``autofit.fit``)
the run writes ``hf/`` when it ends (its last epoch, or ``--max-steps``): the
weights it ended with (as last.pt holds them), its config, and the tokenizer
of the ``hf:`` directory when that has one, so that
``AutoModelForCausalLM.from_pretrained("runs/NAME/hf")`` loads it. A PEFT
model saves its adapter (``PeftModel.save_pretrained``), which
``PeftModel.from_pretrained`` loads over its base; with ``merge`` (``--merge``)
``hf/merged/`` also holds the base with the adapters merged into it
(``merged_state_dict``: PEFT's own delta of each adapted layer added to its
weight, an NF4 base dequantized first), which ``from_pretrained`` loads
alone. The trained model itself is left as it is.

A run owns only the files it writes in ``hf/``: they are written beside as
``hf.partial/``, marked complete (``rundir.HF_COMPLETE``), then each is moved over the
file of its own name (``atomic.move_into``); anything else there (a model card
a user wrote, ``merged/`` of an earlier save) stays. ``hf/`` lists the run's
files (``rundir.HF_OWNED``): ``--overwrite`` sets aside and deletes only those. A crash before the mark
leaves ``hf/`` as it was; after it, the next run in the folder finishes the move
(``rundir.remove_leftovers``).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from autofit.atomic import move_into
from autofit.distributed import is_rank0
from autofit.library_models import hf_dir, quiet_transformers
from autofit.spec import ModelSpec
from autofit.training.rundir import HF_COMPLETE, HF_OWNED
from autofit.training.sharded_checkpoints import full_model_state_dict
from autofit.training.weights import dense, dense_state, disk_full
from strategies import unwrap_model


def pretrained_dir(spec: ModelSpec) -> Path | None:
    """The directory of an ``hf:`` source (where its tokenizer may be); None for other models."""
    return hf_dir(spec.source) if spec.source.startswith("hf:") else None


def saves_pretrained(model: nn.Module) -> bool:
    """True for a model transformers (or PEFT) can save and load: it has ``save_pretrained``."""
    return callable(getattr(unwrap_model(model), "save_pretrained", None))


def merged_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """A PEFT LoRA model's weights with its adapters merged in, under the base model's own names, on the host.

    Each adapted layer's weight is its base weight (dequantized where it is held in NF4) plus PEFT's delta of each
    active adapter (``get_delta_weight``: B @ A times the scale), in fp32 and then the base weight's dtype; the
    adapters' own tensors are left out. The model is not changed.
    """
    from peft.tuners.lora import LoraLayer

    base_model = module.get_base_model()
    merged = {}
    with torch.no_grad():
        for name, tensor in base_model.state_dict().items():
            if ".lora_" not in name:
                merged[name.replace(".base_layer.", ".")] = dense(tensor).detach().cpu()
        for name, layer in base_model.named_modules():
            if not isinstance(layer, LoraLayer):
                continue
            weight = dense(layer.get_base_layer().weight).detach()
            total = weight.float() + sum(layer.get_delta_weight(adapter).float() for adapter in layer.active_adapters)
            merged[f"{name}.weight"] = total.to(weight.dtype).cpu()
    return merged


def save_for_transformers(
    model: nn.Module, *, log_dir: Path, tokenizer_dir: Path | None = None, merge: bool = False,
) -> Path | None:
    """Write ``log_dir/hf`` (see the module docstring); a collective on several processes (rank 0 writes).

    Args:
        merge: also write ``hf/merged``, the LoRA adapters merged into the base (a PEFT model on one process).

    Returns:
        The folder, or None for a model without ``save_pretrained``.

    Raises:
        OSError: a failed write (ENOSPC for a full disk, whichever library said it); ``hf/`` is left as it was.
    """
    if not saves_pretrained(model):
        return None
    state = full_model_state_dict(model)  # whole weights on rank 0 (its own state_dict on one process)
    if not is_rank0():
        return None
    module = unwrap_model(model)
    target, partial = log_dir / "hf", log_dir / "hf.partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with quiet_transformers():
            if hasattr(module, "peft_config"):
                module.save_pretrained(str(partial))  # the adapter: PEFT picks its own tensors
                if merge:
                    module.get_base_model().save_pretrained(str(partial / "merged"), state_dict=merged_state_dict(module))
            else:
                module.save_pretrained(str(partial), state_dict=dense_state(state))  # frozen NF4 weights as dense ones
            tokenizer = _tokenizer(tokenizer_dir)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(partial))
                if merge and (partial / "merged").is_dir():
                    tokenizer.save_pretrained(str(partial / "merged"))
        _list_owned(partial, earlier=target / HF_OWNED)
        (partial / HF_COMPLETE).touch()
    except BaseException as error:
        shutil.rmtree(partial, ignore_errors=True)
        full = disk_full(error, partial) if isinstance(error, Exception) else None
        if full is not None and full is not error:  # safetensors says ENOSPC as a SafetensorError, not an OSError
            raise full from error
        raise
    finish_save(partial, target)
    return target


def _list_owned(partial: Path, *, earlier: Path) -> None:
    """Write ``rundir.HF_OWNED`` into ``partial``: its files, and those an earlier save of the run listed."""
    names = {str(path.relative_to(partial)) for path in partial.rglob("*") if path.is_file()}
    if earlier.is_file():
        try:
            names |= {str(name) for name in json.loads(earlier.read_text(encoding="utf-8"))}
        except (ValueError, UnicodeDecodeError):
            pass  # unreadable: this save's files are still listed
    (partial / HF_OWNED).write_text(json.dumps(sorted(names), indent=1), encoding="utf-8")


def finish_save(partial: Path, target: Path) -> None:
    """Move a complete ``hf.partial/`` into ``hf/``, file by file (see the module docstring)."""
    move_into(partial, target, skip=(HF_COMPLETE,))


def _tokenizer(folder: Path | None):
    """The tokenizer saved in ``folder`` (local files only); None when it holds none."""
    if folder is None or not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
