"""The simulated meter counts a recurrent layer's CPU workspace as the real kernel allocates it.

oneDNN's LSTM kernel (``mkldnn_rnn_layer``) returns a workspace that backward reads; its fake kernel
returns it with 0 bytes. GRU and RNN layers run as ordinary ops on the CPU and are here so that a change
of kernel for them is seen too.
"""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autofit.measure.probe import probe
from autofit.spec import ModelSpec, default_optimizer

VOCAB, SEQ_LEN = 64, 12


class RecurrentLM(nn.Module):
    """An embedding, a recurrent layer stack and a token head: (B, T) -> (B, T, V)."""

    def __init__(self, kind: str, num_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.rnn = getattr(nn, kind)(16, 32, num_layers=num_layers, batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T)
        out, _ = self.rnn(self.embed(tokens))  # (B, T, 32)
        return self.head(out)


def _tokens(n: int):
    tokens = torch.randint(0, VOCAB, (n, SEQ_LEN + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # (B, T, V), (B, T)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _spec(kind: str, num_layers: int) -> ModelSpec:
    return ModelSpec(
        source=f"tests:{kind}LM[{num_layers}]", build_model=lambda: RecurrentLM(kind, num_layers),
        example_batch=_tokens, loss_fn=_token_loss, build_optimizer=default_optimizer,
    )


def _runs(precision: str) -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            RecurrentLM("LSTM", 1)(torch.zeros(1, SEQ_LEN, dtype=torch.long)).sum().backward()
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("precision", [
    "fp32", pytest.param("bf16", marks=pytest.mark.skipif(not _runs("bf16"), reason="no bf16 LSTM on this CPU")),
])
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_simulated_peak_equals_cpu_tracked(kind, num_layers, precision):
    spec = _spec(kind, num_layers)
    settings = dict(micro_batch_size=4, steps=1, precision=precision)
    real = probe(spec, **settings)
    simulated = probe(spec, simulate=True, **settings)
    assert simulated.peak_bytes == real.peak_bytes
