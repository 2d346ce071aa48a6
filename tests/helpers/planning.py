"""Models and model files that several planning tests plan: shared here, never imported from a test module."""
import dataclasses

import torch
from torch import nn

from autofit.spec import ModelSpec, default_optimizer
from tests.helpers.models import layout_specs


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        return torch.relu(self.norm(self.conv(x)))


class UnevenNet(nn.Module):
    """Blocks of very different widths: checkpointing some saves far more than others."""

    def __init__(self, widths=(8, 24, 4, 32, 6)) -> None:
        super().__init__()
        channels = [3, *widths]
        self.blocks = nn.Sequential(*[Block(a, b) for a, b in zip(channels, channels[1:])])
        self.head = nn.Linear(widths[-1], 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(dim=(2, 3)))


def uneven_spec() -> ModelSpec:
    return ModelSpec(
        source="tests:UnevenNet",
        build_model=UnevenNet,
        example_batch=lambda n: (torch.randn(n, 3, 12, 12), torch.randint(0, 10, (n,))),
        loss_fn=nn.functional.cross_entropy,
        build_optimizer=default_optimizer,
        input_shape=(3, 12, 12),
    )


def grid_spec(layout: str):
    spec = layout_specs()[layout]
    return dataclasses.replace(spec, build_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True))


CNN_MODEL_FILE = '''
import torch
from torch import nn

INPUT_SHAPE = (3, 12, 12)


class Block(nn.Module):
    def __init__(self, c_in, c_out):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(3, 16), Block(16, 32), Block(32, 8))
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.blocks(x).mean(dim=(2, 3)))


def build_model():
    return Net()


def example_batch(n):
    return torch.randn(n, 3, 12, 12), torch.randint(0, 10, (n,))
'''


# A small pre-norm decoder LM (3 blocks, about 43k parameters), trained one sequence per step:
# the global batch is the micro-batch, so the floor configuration can step in backward.
LM_MODEL_FILE = '''
from torch.nn import functional as F
from tests.helpers.models import PreNormLM, _tokens

def build_model():
    return PreNormLM()

def example_batch(n):
    return _tokens(n)

def loss_fn(logits, targets):  # (B, T, V), (B, T)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
'''
LM_BLOCKS = ["layers.0", "layers.1", "layers.2"]


STEP_BUDGET = 10_300_000
"""Bytes: above ConvThenWide's floor (9.0 MB), below its plain peak at micro-batch 8 (10.8 MB) and the peak with
its first block checkpointed (10.3 MB); the step in backward brings micro-batch 8 down to 9.8 MB."""


class TwoTowers(nn.Module):
    """A query and a key encoder scoring every query against every key of the batch, as CLIP does: its InfoNCE
    loss (``in_batch_loss``) takes each sample's negatives from the other samples of the same forward."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 16))
        self.keys = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:  # (B, 8), (B, 8) -> (B, B)
        q = nn.functional.normalize(self.queries(queries), dim=-1)
        k = nn.functional.normalize(self.keys(keys), dim=-1)
        return q @ k.T / 0.1


def in_batch_loss(similarities: torch.Tensor, targets) -> torch.Tensor:
    """InfoNCE: sample i's key is the right one among the batch's keys."""
    return nn.functional.cross_entropy(similarities, torch.arange(len(similarities)))


def two_towers_spec() -> ModelSpec:
    def example_batch(n: int):
        queries = torch.randn(n, 8)
        return (queries, queries + 0.1 * torch.randn(n, 8)), None

    return ModelSpec(
        source="tests:TwoTowers", build_model=TwoTowers, example_batch=example_batch, loss_fn=in_batch_loss,
        build_optimizer=default_optimizer,
    )


def chosen_row(plan) -> dict:
    """The plan's own row of its alternatives table."""
    return next(row for row in plan.alternatives if row["chosen"])


def fastest_fitting_row(plan) -> dict:
    """The row of a plan's alternatives table that its own numbers make the fastest that fits (the first on a tie)."""
    fitting = [row for row in plan.alternatives if row["fits_budget"]]
    return max(fitting, key=lambda row: row.get("measured_samples_per_s") or row["predicted_samples_per_s"])


def probed_fits_card(spec: ModelSpec, config: dict, *, micro_batch_size: int, memory_bytes: int) -> bool:
    """Whether a capacity row's configuration (its JSON ``config``), probed on the simulated GPU, fits a card of
    ``memory_bytes`` with the estimated headroom (context, allocator reserve) the table counts."""
    from autofit.measure.probe import probe
    from autofit.planning.memory.headroom import Headroom, persistent_bytes

    result = probe(
        spec, micro_batch_size=micro_batch_size, precision=config["precision"], checkpoint=list(config["checkpoint"]),
        selective_checkpoint=list(config["selective_checkpoint"]), offload=list(config["offload"]),
        optimizer_in_backward=config["optimizer_in_backward"], optimizer_state=config["optimizer_state"],
        loss_chunks=config["loss_chunks"], device="cuda", simulate=True,
    )
    room = Headroom.estimated_cuda(memory_bytes, expandable_segments=True)
    return room.fits(result.peak_bytes, persistent_bytes=persistent_bytes(result.breakdown))
