"""LoRA adapters (PEFT) over any model: ``--lora r=16,alpha=32,targets=q_proj,v_proj``.

The base model's weights are frozen and low-rank adapters are trained beside
the named linear layers (``peft.get_peft_model``). It is part of what the
model is, not a strategy: the spec builds the model with the adapters
(``with_lora``), so planning, probing and training all see the same trainable
parameters (only the adapters have gradients and optimizer state), and a
plan records the adapters in its model part (``model.lora``), from which
training builds them again. The run's ``hf/`` folder then holds the adapter
(``PeftModel.save_pretrained``), which ``PeftModel.from_pretrained`` loads
over the base.

The text is ``key=value`` pairs separated by commas; ``targets`` takes the
module names that follow it up to the next ``key=``:

    r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05

``r`` is required; ``alpha`` defaults to ``r`` (a scale of 1), ``dropout`` to
0; ``targets`` defaults, for a transformers model PEFT knows, to PEFT's own
choice for its architecture (Llama: q_proj and v_proj), and is required for
any other model.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from torch import nn

from autofit.errors import UserError

KEYS = ("r", "alpha", "targets", "dropout")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoraSettings:
    r: int
    alpha: float
    targets: tuple[str, ...] = ()
    """Module names (or name suffixes) to adapt; () leaves the choice to PEFT for a transformers model it knows."""
    dropout: float = 0.0

    def text(self) -> str:
        """The canonical ``--lora`` text: what a plan records and ``parse_lora`` reads back."""
        parts = [f"r={self.r}", f"alpha={self.alpha:g}"]
        parts += [f"targets={','.join(self.targets)}"] if self.targets else []
        parts += [f"dropout={self.dropout:g}"] if self.dropout else []
        return ",".join(parts)


def parse_lora(text: str) -> LoraSettings:
    """``--lora``'s text as settings.

    Raises:
        UserError: an unknown key, a missing or bad value (the line names it and shows the form).
    """
    example = "e.g. --lora r=16,alpha=32,targets=q_proj,v_proj"
    values: dict[str, list[str]] = {}
    key = None
    for part in (p.strip() for p in str(text).split(",")):
        if "=" in part:
            key, _, value = part.partition("=")
            key = key.strip()
            if key not in KEYS:
                raise UserError(f"--lora {text!r}: {key!r} is not a LoRA setting; give {', '.join(KEYS)} ({example})")
            if key in values:
                raise UserError(f"--lora {text!r} gives {key} twice ({example})")
            values[key] = [value.strip()]
        elif key == "targets" and part:
            values[key].append(part)
        elif part:
            raise UserError(f"--lora {text!r}: {part!r} is not key=value ({example})")
    if "r" not in values:
        raise UserError(f"--lora {text!r} needs r, the adapters' rank ({example})")
    try:
        r = int(values["r"][0])
        alpha = float(values["alpha"][0]) if "alpha" in values else float(r)
        dropout = float(values["dropout"][0]) if "dropout" in values else 0.0
    except ValueError:
        raise UserError(f"--lora {text!r}: r is a whole number, alpha and dropout numbers ({example})") from None
    targets = tuple(t for t in values.get("targets", []) if t)
    # float() reads "nan" and "inf" too; neither trains (a nan scale makes every output nan).
    if r < 1 or not 0 < alpha < math.inf or not 0 <= dropout < 1 or ("targets" in values and not targets):
        raise UserError(
            f"--lora {text!r}: r must be at least 1, alpha a positive finite number, dropout in [0, 1), targets not "
            f"empty ({example})"
        )
    return LoraSettings(r=r, alpha=alpha, targets=targets, dropout=dropout)


def planned_lora(given: str | None, planned: str | None, *, flag: str, spell: Callable[[str], str]) -> LoraSettings | None:
    """The adapters a plan trains with: those it recorded (``planned``); None where it has none.

    Args:
        given: the adapters asked for again (``--lora``, ``lora=``): they must be the plan's.
        flag, spell: how the user spells the option, and a value of it ("--lora", ``lambda v: f"--lora {v}"``).

    Raises:
        UserError: ``given`` differs from the plan's (the plan's memory holds for its own model only).
    """
    if given is not None and parse_lora(given).text() != planned:
        made = f"with {spell(planned)}" if planned else f"without {flag}"
        raise UserError(f"the plan was made {made}, and its memory holds for that; drop {flag} here, or plan again with {spell(given)}")
    return parse_lora(planned) if planned else None


def lora_model(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """``model`` with LoRA adapters (PEFT): the base frozen, the adapters trainable.

    Raises:
        UserError: PEFT is not installed, or no module matches the targets (the line lists some linear layers' names).
    """
    try:
        import peft
    except ImportError:
        raise UserError("--lora needs PEFT: pip install peft (or 'autofit[hf]')") from None
    config = peft.LoraConfig(
        r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=list(settings.targets) or None,
    )
    try:
        return peft.get_peft_model(model, config)
    except ValueError as error:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        first = str(error).strip().splitlines()[0][:200]
        raise UserError(
            f"--lora {settings.text()}: PEFT could not adapt this model ({first}); name its linear layers in "
            f"targets=..., e.g. among {', '.join(linear[:8]) or 'none found'}"
        ) from None


def with_lora(build: Callable[[], nn.Module], settings: LoraSettings) -> Callable[[], nn.Module]:
    """A model builder that adds the adapters to what ``build`` makes."""

    def build_with_lora() -> nn.Module:
        return lora_model(build(), settings)

    return build_with_lora
