"""A tiny classifier, its data and plan, and the shared loop run over them: what the training tests share."""
import torch
from torch import nn

from autofit.config import TrainingConfig
from autofit.plan_file import DeviceInfo, ModelInfo, Plan
from autofit.spec import model_fingerprint
from autofit.training.data import TrainData
from autofit.training.loop import TrainSettings, train

FEATURES, CLASSES, SAMPLES = 16, 3, 40


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):  # (B, FEATURES)
        return x + self.dropout(torch.tanh(self.linear(x)))


class TinyNet(nn.Module):
    """(B, 1, 4, 4) -> (B, CLASSES); blocks in a Sequential are the checkpoint candidates."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(dropout) for _ in range(3)))
        self.head = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        return self.head(self.blocks(x.flatten(1)))


def make_data(samples: int = SAMPLES, *, val: bool = True) -> TrainData:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(samples, 1, 4, 4, generator=generator)
    targets = torch.randint(0, CLASSES, (samples,), generator=generator)
    dataset = torch.utils.data.TensorDataset(inputs, targets)
    return TrainData(train=dataset, val=torch.utils.data.Subset(dataset, range(12)) if val else None)


def make_plan(model: nn.Module, *, global_batch_size=8, micro_batch_size=3, precision="fp32", checkpoint=("blocks.0", "blocks.1", "blocks.2")) -> Plan:
    return Plan(
        model=ModelInfo(source="tests/training/test_loop.py", fingerprint=model_fingerprint(model), input_shape=[1, 4, 4], num_classes=CLASSES),
        device=DeviceInfo(type="cpu"), budget_bytes=10**8,
        config=TrainingConfig(
            global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, precision=precision, checkpoint=list(checkpoint),
        ),
    )


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)


def run(model, plan, log_dir, *, data=None, loss_fn=nn.functional.cross_entropy, **settings):
    settings.setdefault("epochs", 2)
    settings.setdefault("verbose", False)
    return train(
        model, plan=plan, data=data or make_data(), loss_fn=loss_fn, build_optimizer=optimizer,
        model_source={"source": "tests/training/test_loop.py", "input_shape": "1x4x4", "num_classes": CLASSES},
        settings=TrainSettings(log_dir=log_dir, **settings),
    )


def fresh_model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return TinyNet(dropout)


def assert_same_weights(a: nn.Module, b: nn.Module, *, exact: bool) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        if exact:
            assert torch.equal(x, y), name
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)
