"""`autofit ARGS` as on a machine the planner sees as quiet at every reading of the other work (#47).

The planner takes PyTorch's intra-op threads (two on the dev machine) where no other work is seen when a plan
starts or its timing begins (``autofit.planning.context.timing_threads``). Here that rule always answers so, so
a plan times with PyTorch's threads unless its own timings repeat too poorly on them and it falls back to one
(``POLICY.threads_noise_share``): what a plan started on a quiet machine meets when other work begins mid-plan.

    PYTHONPATH=TREE python bench/quiet_start.py plan bench/models47/mamba_like.py --budget 30MiB --batch-size 32 --out plan.json
"""
import torch

import autofit.planning.context as context

context.timing_threads = lambda device: (torch.get_num_threads(), "")  # no other work seen, at every reading

from autofit.entry import run  # noqa: E402

run()
