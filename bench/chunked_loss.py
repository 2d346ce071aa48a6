"""What the chunked output layer and loss saves on a language model at real size (simulated, nothing downloaded).

A Llama-3.2-1B-shaped config (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, vocabulary
128,256) written to a temporary directory is probed over fake tensors for a GPU (``probe --simulate
--device cuda``: the simulated meter, no arithmetic) at 2,048 tokens per sequence, with every block
checkpointed (where the logits weigh most), in bf16 autocast, at micro-batches 1 and 4: the peak with the
model's own loss beside the peak with the loss in 8 chunks, side by side in one run.

    python bench/chunked_loss.py            # about 2 minutes on 2 cores
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autofit.measure.probe import probe  # noqa: E402
from autofit.planning.memory.traces import simulation_spec  # noqa: E402
from autofit.spec import load_spec  # noqa: E402
from autofit.units import format_bytes  # noqa: E402

LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=131072, tie_word_embeddings=True, architectures=["LlamaForCausalLM"],
)
SEQ_LEN = 2048


def main() -> None:
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as folder:
        transformers.LlamaConfig(**LLAMA_1B).save_pretrained(folder)
        spec = simulation_spec(load_spec(f"hf:{folder}", task="causal-lm", seq_len=SEQ_LEN))
        print(f"torch {torch.__version__}; Llama-3.2-1B-shaped, {SEQ_LEN} tokens, bf16 autocast, every block checkpointed, "
              "simulated for cuda")
        for micro in (1, 4):
            peaks = {}
            for chunks in (1, 8):
                started = time.perf_counter()
                peaks[chunks] = probe(
                    spec, micro_batch_size=micro, precision="bf16", checkpoint="all", loss_chunks=chunks, device="cuda",
                    simulate=True, steps=1,
                ).peak_bytes
                print(f"  micro-batch {micro}, loss in {chunks} chunk(s): peak {format_bytes(peaks[chunks])} "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
            print(f"  micro-batch {micro}: chunked / whole = {peaks[8] / peaks[1]:.3f}, "
                  f"{format_bytes(peaks[1] - peaks[8])} less")


if __name__ == "__main__":
    main()
