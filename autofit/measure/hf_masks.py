"""transformers' attention masks over fake tensors, decided as a real run of the same batch decides them.

A transformers decoder skips its 4-D causal mask when the batch's 2-D
attention mask has no padding (or, without one, when its positions hold one
sequence per row): SDPA then runs with ``is_causal`` and grouped-query
attention without repeating the key/value heads. Both checks read values, so
over fake tensors transformers takes the cautious path: it builds the
(B, 1, T, T) mask, repeats the key and value heads for every layer, and the
simulated meter counts bytes no real run holds (10% of a tiny Llama's peak).

Inside ``masks_as_in_real_runs()`` a fake padding mask is taken as all ones
and fake positions as one sequence per row, as a real run of the same batch
finds them: the example batch, made once more of real tensors (``meters.noting_padding``), says
whether its attention mask pads (``note_example_batch``). A batch that pads keeps transformers' cautious path,
which the real run takes too.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from autofit._torch_private import FakeTensor

_unpadded = False
"""Whether the example batch of the simulated run now on (``note_example_batch``) pads none of its sequences; until
one is noted, transformers' cautious path is kept."""


def note_example_batch(batch) -> None:
    """Remember whether ``batch`` (real tensors: ``(inputs, targets)``) has an attention mask with padding in it
    (None: not known, so it may)."""
    global _unpadded
    if batch is None:
        _unpadded = False
        return
    inputs = batch[0] if isinstance(batch, tuple) and batch else batch
    mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
    _unpadded = not (hasattr(mask, "all") and not isinstance(mask, FakeTensor) and not bool(mask.all()))


@contextmanager
def masks_as_in_real_runs() -> Iterator[None]:
    """Within it, transformers decides its attention masks over fake tensors as a real run of the example batch noted
    inside it (``note_example_batch``) does: none noted, the cautious path. Nothing noted in one run carries over."""
    global _unpadded
    _unpadded = False
    if "transformers" not in sys.modules:  # no transformers model can run: nothing to decide
        yield
        return
    try:
        masking = importlib.import_module("transformers.masking_utils")
        skip, packed = masking._ignore_causal_mask_sdpa, masking.find_packed_sequence_indices
    except (ImportError, AttributeError):  # another transformers: its own rules, counted as they are
        yield
        return

    def skip_as_unpadded(padding_mask, *args, **kwargs):
        return skip(None if isinstance(padding_mask, FakeTensor) and _unpadded else padding_mask, *args, **kwargs)

    def one_sequence_per_row(position_ids):
        return None if isinstance(position_ids, FakeTensor) and _unpadded else packed(position_ids)

    masking._ignore_causal_mask_sdpa, masking.find_packed_sequence_indices = skip_as_unpadded, one_sequence_per_row
    try:
        yield
    finally:
        masking._ignore_causal_mask_sdpa, masking.find_packed_sequence_indices = skip, packed
