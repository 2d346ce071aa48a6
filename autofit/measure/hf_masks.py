"""transformers' attention masks over fake tensors, decided as a real run of the same batch decides them.

A transformers decoder skips its 4-D causal mask when the batch's 2-D
attention mask has no padding (or, without one, when its positions hold one
sequence per row): SDPA then runs with ``is_causal`` and grouped-query
attention without repeating the key/value heads. Both checks read values, so
over fake tensors transformers takes the cautious path: it builds the
(B, 1, T, T) mask, repeats the key and value heads for every layer, and the
simulated meter counts bytes no real run holds (10% of a tiny Llama's peak).

Inside ``masks_as_in_real_runs()`` a fake padding mask is taken as all ones
and fake positions as one sequence per row, which is what autofit's example
batches hold (``library_models.causal_lm_batch``: every token attends). A
model file whose example batch pads is then counted without its mask (B x T
x T booleans) and its key/value copies.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from autofit._torch_private import FakeTensor


@contextmanager
def masks_as_in_real_runs() -> Iterator[None]:
    """Within it, transformers decides its attention masks over fake tensors as over an unpadded real batch."""
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
        return skip(None if isinstance(padding_mask, FakeTensor) else padding_mask, *args, **kwargs)

    def one_sequence_per_row(position_ids):
        return None if isinstance(position_ids, FakeTensor) else packed(position_ids)

    masking._ignore_causal_mask_sdpa, masking.find_packed_sequence_indices = skip_as_unpadded, one_sequence_per_row
    try:
        yield
    finally:
        masking._ignore_causal_mask_sdpa, masking.find_packed_sequence_indices = skip, packed
