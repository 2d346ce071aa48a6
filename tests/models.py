"""Tiny models for the tests: a ResNet, transformers with MHA and SDPA."""
import importlib.util

import torch
import torchvision

from autofit.spec import ModelSpec, default_optimizer, load_spec
from tests.conftest import EXAMPLES


def resnet_spec() -> ModelSpec:
    return load_spec("torchvision:resnet18", input_shape="3x32x32", num_classes=10)


def transformer_module(attention: str):
    spec = importlib.util.spec_from_file_location(f"tiny_transformer_{attention}", EXAMPLES / "tiny_transformer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.ATTENTION = attention
    module.SEQ_LEN = 32
    module.N_LAYERS = 3
    return module


def transformer_spec(attention: str) -> ModelSpec:
    module = transformer_module(attention)
    return ModelSpec(
        source=f"tiny_transformer[{attention}]",
        build_model=lambda: module.TinyTransformer(attention),
        example_batch=module.example_batch,
        loss_fn=torch.nn.functional.cross_entropy,
        build_optimizer=default_optimizer,
    )
