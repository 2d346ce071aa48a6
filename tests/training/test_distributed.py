"""Distributed training: the rank split's mathematics here, real 2-process gloo runs under torchrun.

The 2-process runs (tests/helpers/dist_worker.py) start twice per session: once for
every training scenario and a DCP save, once to resume from that save.
"""
import json
import os
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from autofit.planning.memory.per_rank import estimate_fsdp_peak_bytes, fsdp_layout, simulate_fsdp_peak_bytes
from autofit.distributed import check_launch, init_distributed
from autofit.training.sharded_checkpoints import load_sharded_checkpoint
from strategies.batch_split import BatchSplit, rank_slice
from strategies.sharding import GradientSync, Sharding, ShardingConfig, mixed_precision_policy
from autofit.errors import UserError
from autofit.measure.probe import probe
from autofit.spec import ModelSpec
from strategies import BatchSplitConfig
from tests.helpers import dist_worker
from tests.helpers import ROOT

WORLD_SIZE = 2
needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)
# The tests on `runs` (two torchrun launches, 25-40 s) are marked slow: -m "not slow" leaves them out.

SCENARIOS = [
    {"name": "fsdp_k1", "sharding": "fsdp", "global_batch_size": 8, "micro_batch_size": 4, "steps": 5},
    {"name": "fsdp_k2_checkpointed", "sharding": "fsdp", "global_batch_size": 8, "micro_batch_size": 2, "steps": 5, "checkpoint": "all"},
    {"name": "fsdp_uneven", "sharding": "fsdp", "global_batch_size": 5, "micro_batch_size": 2, "steps": 5},
    {"name": "ddp_k1", "sharding": "ddp", "global_batch_size": 8, "micro_batch_size": 4, "steps": 5},
    {"name": "ddp_k2", "sharding": "ddp", "global_batch_size": 8, "micro_batch_size": 2, "steps": 5},
    {"name": "ddp_uneven", "sharding": "ddp", "global_batch_size": 5, "micro_batch_size": 2, "steps": 5},
    # Gradient clipping on the sharded gradients (FSDP2: a DTensor norm made whole) and on DDP's reduced ones;
    # the norm is small enough that every step clips.
    {"name": "fsdp_clipped", "sharding": "fsdp", "global_batch_size": 8, "micro_batch_size": 2, "steps": 5, "max_grad_norm": 0.05},
    {"name": "ddp_clipped", "sharding": "ddp", "global_batch_size": 8, "micro_batch_size": 2, "steps": 5, "max_grad_norm": 0.05},
    {"name": "fsdp_bf16", "sharding": "fsdp", "global_batch_size": 8, "micro_batch_size": 2, "steps": 5, "precision": "bf16"},
    {"name": "fsdp_fp16", "sharding": "fsdp", "global_batch_size": 8, "micro_batch_size": 2, "steps": 5, "precision": "fp16"},
    {"name": "fsdp_saved", "sharding": "fsdp", "global_batch_size": 8, "micro_batch_size": 2, "steps": 5, "save_at": 3},
    {"name": "ddp_saved", "sharding": "ddp", "global_batch_size": 8, "micro_batch_size": 2, "steps": 5, "save_at": 3},
    # Activations dominate, as in real training: 256 samples per rank.
    {"name": "memory", "sharding": "fsdp", "global_batch_size": 512, "micro_batch_size": 256, "steps": 3, "track_memory": True},
]


def _torchrun(tmp_path, name: str, scenarios: list[dict]) -> dict:
    scenarios_path, out_path = tmp_path / f"{name}.json", tmp_path / f"{name}-out.json"
    scenarios_path.write_text(json.dumps(scenarios))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}",
        str(ROOT / "tests" / "helpers" / "dist_worker.py"), str(scenarios_path), str(out_path),
    ]
    # PYTHONFAULTHANDLER: a rank that aborts prints every thread's Python stack, so a failure says where.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"torchrun failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    report = json.loads(out_path.read_text())
    assert report["world_size"] == WORLD_SIZE
    return report["results"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both 2-process launches: the scenarios (with DCP saves at step 3), then the resumes."""
    tmp_path = tmp_path_factory.mktemp("distributed")
    scenarios = [dict(s) for s in SCENARIOS]
    for scenario in scenarios:
        if "save_at" in scenario:
            scenario["save_to"] = str(tmp_path / scenario["name"])
    first = _torchrun(tmp_path, "first", scenarios)
    resumes = [
        {**{k: v for k, v in s.items() if k not in ("save_at", "save_to")}, "name": s["name"] + "_resumed", "resume_from": s["save_to"]}
        for s in scenarios if "save_at" in s
    ]
    second = _torchrun(tmp_path, "second", resumes)
    for scenario in scenarios:
        if "save_to" in scenario:
            first[scenario["name"]]["save_to"] = scenario["save_to"]
    return {**first, **second}


def _reference(name: str) -> dict:
    """The same scenario on one process: plain model, BatchSplit over the whole global batch."""
    scenario = {**next(s for s in SCENARIOS if s["name"] == name), "sharding": "none"}
    scenario.pop("save_at", None)
    scenario.pop("track_memory", None)
    return dist_worker.run_scenario(scenario, env=init_distributed(device_type="cpu"))


def _assert_same_training(run: dict, reference: dict, *, rtol: float) -> None:
    assert torch.allclose(torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=rtol, atol=0), (run["losses"], reference["losses"])
    assert run["weights"].keys() == reference["weights"].keys()
    for name, digest in run["weights"].items():
        assert torch.allclose(torch.tensor(digest), torch.tensor(reference["weights"][name]), rtol=rtol, atol=1e-5), name


# ------------------------------------------------------------------------------------------------
# 2 processes under torchrun (gloo)
# ------------------------------------------------------------------------------------------------


@needs_gloo
@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp_k1", "fsdp_k2_checkpointed", "fsdp_uneven", "ddp_k1", "ddp_k2", "ddp_uneven", "fsdp_clipped", "ddp_clipped"])
def test_two_processes_train_like_one(runs, name):
    """Same global batch, seed and AdamW: the same loss curve and weights as one process (fp32)."""
    _assert_same_training(runs[name], _reference(name), rtol=1e-4)


@needs_gloo
@pytest.mark.slow
def test_accumulation_reduces_gradients_once_per_step(runs):
    """no_sync / set_requires_gradient_sync: two micro-batches communicate as often as one."""
    model = dist_worker.build_model()
    fsdp_groups = len(fsdp_layout(model, world_size=WORLD_SIZE).unit_numels) + 1  # the units and the root
    assert runs["fsdp_k1"]["reductions_per_step"] == fsdp_groups
    assert runs["fsdp_k2_checkpointed"]["reductions_per_step"] == fsdp_groups
    assert runs["ddp_k1"]["reductions_per_step"] >= 1
    assert runs["ddp_k2"]["reductions_per_step"] == runs["ddp_k1"]["reductions_per_step"]


@needs_gloo
@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp_bf16", "fsdp_fp16"])
def test_mixed_precision_policy_trains(runs, name):
    """bf16/fp16 parameters in compute (ShardedGradScaler for fp16): close to one process at that precision.

    Not equal: FSDP computes whole modules in the low dtype, autocast only some ops.
    """
    _assert_same_training(runs[name], _reference(name), rtol=2e-2)


@needs_gloo
@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp_saved", "ddp_saved"])
def test_resume_after_restart_continues_exactly(runs, name):
    """Saved with DCP after step 3, restarted as 2 new processes: steps 4-5 as if never stopped."""
    resumed, uninterrupted = runs[name + "_resumed"], runs[name]
    _assert_same_training(resumed, uninterrupted, rtol=1e-6)


@needs_gloo
@pytest.mark.slow
def test_one_process_resumes_a_two_process_fsdp_save(runs):
    """DCP reshards: the 2-rank FSDP save at step 3 continues in one plain process as it did on two."""
    scenario = {**next(s for s in SCENARIOS if s["name"] == "fsdp_saved"), "sharding": "none"}
    del scenario["save_at"]
    scenario["resume_from"] = runs["fsdp_saved"]["save_to"]
    resumed = dist_worker.run_scenario(scenario, env=init_distributed(device_type="cpu"))
    _assert_same_training(resumed, runs["fsdp_saved"], rtol=1e-5)


def test_loading_a_missing_sharded_checkpoint_names_it(tmp_path):
    model = dist_worker.build_model()
    with pytest.raises(UserError, match="holds no complete sharded checkpoint"):
        load_sharded_checkpoint(tmp_path / "nothing", model=model, optimizer=dist_worker.build_optimizer(model.parameters()))


@needs_gloo
@pytest.mark.slow
def test_per_rank_peak_matches_the_simulation_and_stays_under_the_estimate(runs):
    scenario = next(s for s in SCENARIOS if s["name"] == "memory")
    micro_batch_size = scenario["micro_batch_size"]
    measured = runs["memory"]["rank_peak_bytes"]
    spec = ModelSpec(
        source="dist_worker.MLP", build_model=dist_worker.build_model,
        example_batch=lambda n: dist_worker.global_batch(0, global_batch_size=n),
        loss_fn=F.cross_entropy, build_optimizer=dist_worker.build_optimizer,
    )
    simulated = simulate_fsdp_peak_bytes(spec, world_size=WORLD_SIZE, micro_batch_size=micro_batch_size, backend="gloo").peak_bytes

    model = dist_worker.build_model()
    layout = fsdp_layout(model, world_size=WORLD_SIZE)
    single = probe(spec, micro_batch_size=micro_batch_size, simulate=True)
    b = single.breakdown
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    estimate = estimate_fsdp_peak_bytes(
        parameter_bytes=parameter_bytes, gradient_bytes=parameter_bytes, optimizer_state_bytes=b["optimizer_state"],
        activation_bytes=single.peak_bytes - b["parameters"] - b["gradients"] - b["optimizer_state"],
        layout=layout, world_size=WORLD_SIZE, precision="fp32",
    ).peak_bytes
    print(
        f"\nper-rank peak bytes measured {measured}, simulated with gloo's copy {simulated} (measured/simulated "
        f"{[round(m / simulated, 4) for m in measured]}), estimated {estimate} "
        f"(measured/estimated {[round(m / estimate, 3) for m in measured]})"
    )
    # The simulation runs FSDP2 itself on a fake process group, plus one copy of the largest
    # unit (fp32) that gloo's reduce-scatter may hold inside itself at the peak: a real rank
    # lies between the simulation without that copy and with it.
    # Rank 0 holds the largest shards (FSDP2 pads at the end): the simulation is of rank 0.
    gloo_copy_bytes = layout.largest_unit_numel * 4
    assert all(rank_bytes <= simulated for rank_bytes in measured)
    assert max(measured) >= simulated - gloo_copy_bytes
    assert max(measured) >= 0.95 * simulated
    # The formula adds every maximum as if they coincided: never below, and not far above.
    assert max(measured) <= estimate <= 1.2 * max(measured)


# ------------------------------------------------------------------------------------------------
# One process: the rank split's mathematics, configs and messages
# ------------------------------------------------------------------------------------------------


class _RecordingSync(GradientSync):
    def __init__(self) -> None:
        self.deferred_calls = 0
        self.inside = False

    @contextmanager
    def deferred(self):
        self.deferred_calls += 1
        self.inside = True
        yield
        self.inside = False


@pytest.mark.parametrize("batch_len", range(1, 10))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rank_slices_cover_the_batch_once(batch_len, world_size):
    slices = [rank_slice(batch_len, rank=r, world_size=world_size) for r in range(world_size)]
    assert [s.start for s in slices] == [0] + [s.stop for s in slices[:-1]]
    assert slices[-1].stop == batch_len
    assert max(s.stop - s.start for s in slices) - min(s.stop - s.start for s in slices) <= 1


@pytest.mark.parametrize(("global_batch_size", "micro_batch_size", "world_size"), [(8, 2, 2), (5, 2, 2), (7, 3, 3), (2, 1, 3), (6, 4, 2)])
def test_rank_split_averages_to_the_global_mean_gradient(global_batch_size, micro_batch_size, world_size):
    """Ranks' weighted micro-batch gradients, averaged as DDP/FSDP average them, equal the global batch's."""
    model = dist_worker.build_model()
    inputs, targets = dist_worker.global_batch(0, global_batch_size=global_batch_size)
    F.cross_entropy(model(inputs), targets).backward()
    expected = [p.grad.clone() for p in model.parameters()]

    rank_grads, counts = [], []
    for rank in range(world_size):
        model.zero_grad()
        sync = _RecordingSync()
        split = BatchSplit(
            BatchSplitConfig(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size),
            rank=rank, world_size=world_size, sync=sync,
        )
        pieces = 0
        for micro_inputs, micro_targets, weight in split.micro_batches(inputs, targets):
            assert len(micro_targets) <= micro_batch_size
            (F.cross_entropy(model(micro_inputs), micro_targets) * weight).backward()
            pieces += 1
            last_is_synced = not sync.inside
        assert last_is_synced and sync.deferred_calls == pieces - 1
        counts.append(pieces)
        rank_grads.append([p.grad.clone() for p in model.parameters()])
    assert len(set(counts)) == 1  # every rank joins every forward's collectives
    averaged = [sum(grads) / world_size for grads in zip(*rank_grads)]
    for got, want in zip(averaged, expected):
        assert torch.allclose(got, want, atol=1e-6)


def test_outside_torchrun_is_one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    env = init_distributed(device_type="cpu")
    assert (env.rank, env.world_size, env.local_rank, env.device) == (0, 1, 0, torch.device("cpu"))
    model = dist_worker.build_model()
    assert Sharding(ShardingConfig(), precision="fp32", device="cpu").apply(model) is model
    with pytest.raises(UserError, match="torchrun"):
        Sharding(ShardingConfig(world_size=2, sharding="fsdp"), precision="fp32", device="cpu").apply(model)


def test_a_multi_process_plan_names_the_torchrun_command(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = ShardingConfig(world_size=4, sharding="fsdp")
    with pytest.raises(UserError, match=r"torchrun --nproc-per-node 4 -m autofit train --plan plan.json"):
        check_launch(config, args=["train", "--plan", "plan.json"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="--nproc-per-node 4"):
        check_launch(config, args=["train"])
    check_launch(ShardingConfig(world_size=2, sharding="ddp"), args=["train"])
    # On several nodes: one command per node, each with its rank, meeting at node 0.
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(UserError) as refused:
        check_launch(ShardingConfig(world_size=4, sharding="hsdp", nodes=2), args=["train", "--plan", "plan.json"])
    for rank in (0, 1):
        assert (f"on node {rank}: torchrun --nnodes 2 --node-rank {rank} --nproc-per-node 2 --master-addr NODE0_ADDRESS "
                "--master-port 29500 -m autofit train --plan plan.json") in str(refused.value)


def test_hsdp_shards_within_a_node_and_replicates_across_nodes():
    """Four ranks as two nodes of two (on a fake process group): every parameter is a DTensor over a 2 x 2 mesh,
    replicated over the nodes' dimension and sharded over the node's own."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from autofit._torch_private import fake_process_group_store

    dist.init_process_group("fake", store=fake_process_group_store(), rank=0, world_size=4)
    try:
        model = dist_worker.build_model()
        Sharding(ShardingConfig(world_size=4, sharding="hsdp", nodes=2), precision="fp32", device="cpu").apply(model)
        params = list(model.parameters())
        assert params and all(isinstance(p, DTensor) for p in params)
        assert all(p.device_mesh.shape == (2, 2) and p.placements == (Replicate(), Shard(0)) for p in params)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"world_size": 2, "sharding": "zero3"}, "sharding 'zero3' is unknown"),
    ({"world_size": 0, "sharding": "fsdp"}, "--gpus 0"),
    ({"world_size": 2, "sharding": "none"}, "needs a sharding"),
    ({"world_size": 4, "sharding": "fsdp", "nodes": 3}, "--nodes 3 must be .* that divides the 4 processes"),
    ({"world_size": 4, "sharding": "hsdp", "nodes": 1}, "needs 2 nodes or more of 2 GPUs or more"),
    ({"world_size": 4, "sharding": "hsdp", "nodes": 4}, "needs 2 nodes or more of 2 GPUs or more"),
])
def test_bad_distributed_configs_fail_early(kwargs, message):
    with pytest.raises(UserError, match=message):
        ShardingConfig(**kwargs)


def test_mixed_precision_policy_follows_the_plan():
    assert mixed_precision_policy("fp32").param_dtype is None
    bf16 = mixed_precision_policy("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision_policy("fp16").param_dtype == torch.float16


def test_estimate_divides_states_and_adds_unit_buffers():
    layout = fsdp_layout(dist_worker.build_model(), world_size=2)
    unit = layout.largest_unit_numel
    estimate = estimate_fsdp_peak_bytes(
        parameter_bytes=1000, gradient_bytes=1000, optimizer_state_bytes=2000, activation_bytes=500,
        layout=layout, world_size=2, precision="bf16",
    )
    assert estimate.state_bytes == 2000
    assert estimate.buffer_bytes == (layout.root_numel + 3 * unit) * 2 + unit * 4
    assert estimate.peak_bytes == 2000 + 500 + estimate.buffer_bytes
    # Accumulating without sync keeps whole gradients.
    deferred = estimate_fsdp_peak_bytes(
        parameter_bytes=1000, gradient_bytes=1000, optimizer_state_bytes=2000, activation_bytes=500,
        layout=layout, world_size=2, precision="bf16", grad_accum_steps=4,
    )
    assert deferred.state_bytes == 2500
