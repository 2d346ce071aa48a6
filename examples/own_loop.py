"""Your own training loop with a plan: ``autofit.apply_plan``'s hooks, on one process or under torchrun.

    python examples/own_loop.py plan.json                          # a plan for one process
    torchrun --nproc-per-node 2 examples/own_loop.py plan2.json    # a plan with world_size 2 (ddp or fsdp)

The loop is the same for every plan: ``apply_plan`` joins torchrun's process
group when the plan says so, shards (FSDP2) or wraps (DDP) the model, and
``micro_batches`` yields only this rank's share of each global batch, weighted
so that the gradient is the whole batch's mean. The plan must be one for this
file's model (``autofit plan examples/own_loop.py ...``) or written by hand
(no fingerprint), as docs/multi-gpu.md does.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import autofit


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def example_batch(batch_size: int, *, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 16, generator=generator), torch.randint(0, 4, (batch_size,), generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="a plan.json for this model")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    args = parser.parse_args()

    plan = autofit.load_plan(args.plan)
    torch.manual_seed(0)  # the same initial weights on every rank (rank 0's are broadcast anyway)
    applied = autofit.apply_plan(build_model(), plan)
    optimizer = applied.build_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-2))
    # Every rank draws the same global batches; micro_batches takes this rank's share of each.
    batches = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        inputs, targets = example_batch(plan.config.global_batch_size, generator=batches)
        # Weights are world_size x each micro-batch's share of the batch, as the ranks' gradients are averaged:
        # so this adds up to the mean loss over this rank's share.
        rank_loss = 0.0
        for x, y, weight in applied.micro_batches(inputs, targets):
            with applied.forward_context():
                loss = nn.functional.cross_entropy(applied.model(x.to(applied.device)), y.to(applied.device)) * weight
            applied.backward(loss)
            rank_loss += loss.item()
        applied.optimizer_step(optimizer)
        optimizer.zero_grad()
        if applied.env.rank == 0:
            print(f"step {step + 1}: rank 0 of {applied.env.world_size}, its share's loss {rank_loss:.4f}, "
                  f"{applied.grad_accum_steps} micro-batch(es) of {applied.micro_batch_size}")
    if applied.env.world_size > 1:
        # A rank that left first would close connections another still uses: gloo then aborts that one.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
