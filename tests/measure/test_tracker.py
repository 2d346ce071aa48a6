import gc
import itertools

import torch
from torch import nn

from autofit.measure.tracker import StorageTracker


def test_counts_storages_created_and_freed():
    tracker = StorageTracker()
    with tracker:
        a = torch.ones(1000)  # 4000 bytes
        b = torch.ones(250, dtype=torch.float64)  # 2000 bytes
        assert tracker.current_bytes == 6000
        view = b[10:20]  # a view shares b's storage: nothing new
        b.add_(1)  # in place: nothing new
        assert tracker.current_bytes == 6000
        del a
        gc.collect()
        assert tracker.current_bytes == 2000
        c = torch.ones(10, dtype=torch.int8)
        assert tracker.current_bytes == 2010
    assert tracker.peak_bytes == 6000
    del view, b, c


def test_tensors_made_before_are_tracked_on_request_and_labelled():
    weight = torch.zeros(100, 10)  # 4000 bytes
    tracker = StorageTracker()
    tracker.track([weight], "parameters")
    with tracker:
        x = torch.ones(8, 100)  # 3200 bytes
        y = x @ weight  # 320 bytes
    assert tracker.peak_bytes == 4000 + 3200 + 320
    assert tracker.breakdown_at_peak() == {"parameters": 4000, "gradients": 0, "optimizer_state": 0, "activations": 3520}
    del x, y


def test_breakdown_is_taken_at_the_peak_not_at_the_end():
    tracker = StorageTracker()
    with tracker:
        big = torch.ones(1000)
        del big
        gc.collect()
        small = torch.ones(10)
    assert tracker.peak_bytes == 4000
    assert tracker.breakdown_at_peak()["activations"] == 4000
    del small


def test_rounding_mimics_a_block_allocator():
    tracker = StorageTracker(round_bytes=512)
    with tracker:
        t = torch.ones(3)  # 12 bytes -> one 512-byte block
    assert tracker.peak_bytes == 512
    del t


def test_linear_training_step_matches_hand_computed_bytes():
    torch.manual_seed(0)
    model = nn.Linear(64, 32, bias=False)  # weight: 8192 bytes
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no state
    tracker = StorageTracker()
    tracker.track(model.parameters(), "parameters")
    with tracker:
        x = torch.randn(16, 64)  # 4096 bytes
        out = model(x)  # 16x32 fp32 = 2048 bytes
        loss = out.square().mean()
        loss.backward()
        optimizer.step()
    # Parameters, input, output and the weight's gradient (8192) are alive together at least.
    assert tracker.peak_bytes >= 8192 + 4096 + 2048 + 8192
    assert tracker.breakdown_at_peak()["parameters"] == 8192
    # and nothing bigger than a few 16x32 temporaries beyond that
    assert tracker.peak_bytes <= 8192 + 4096 + 2048 + 8192 + 3 * 2048


def test_fake_normalisation_statistics_count_as_the_real_kernel_holds_them():
    """Fake norms return statistics in the input's dtype; the CPU kernels keep them in the widest of input and weights."""
    from autofit._torch_private import new_fake_mode

    def counted(norm, shape):
        tracker = StorageTracker()
        with tracker:
            x = torch.ones(shape, dtype=torch.bfloat16)
            out = norm(x)
        del x, out
        return tracker.peak_bytes

    layouts = [  # a bf16 input (as autocast gives a norm after a convolution) to fp32, bf16 and no weights
        (lambda dtype: nn.BatchNorm2d(8, dtype=dtype), (2, 8, 3, 3)),
        (lambda dtype: nn.BatchNorm2d(8, affine=False, dtype=dtype), (2, 8, 3, 3)),
        (lambda dtype: nn.LayerNorm(8, dtype=dtype), (2, 3, 8)),
        (lambda dtype: nn.LayerNorm(8, elementwise_affine=False, dtype=dtype), (2, 3, 8)),
        (lambda dtype: nn.GroupNorm(2, 8, dtype=dtype), (2, 8, 3, 3)),
    ]
    for (make, shape), dtype in itertools.product(layouts, (torch.float32, torch.bfloat16)):
        real = counted(make(dtype), shape)
        with new_fake_mode():
            fake = counted(make(dtype), shape)
        assert fake == real, (make(dtype), dtype)
