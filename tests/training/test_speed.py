"""Training runs at the plan's speed: the plan's thread count, and the run's speed printed beside the plan's."""
from dataclasses import replace

import pytest
import torch
from torch import nn

from autofit.errors import UserError
from autofit.plan_file import Measured, load_plan, plan_from_dict, save_plan
from autofit.training.loop import TrainSettings
from autofit.training.run import run_training
from autofit.training.speed import StepSpeed
from autofit.training.threads import default_workers, threads_for
from tests.helpers.training import fresh_model, make_data, make_plan, optimizer


@pytest.fixture(autouse=True)
def threads_put_back():
    """These tests set PyTorch's thread count; the next test finds it as it was."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _measured(**fields) -> Measured:
    return Measured(**{"peak_bytes": 1000, "samples_per_s": 100.0, "meter": "cpu", **fields})


def test_training_uses_the_threads_the_plan_was_timed_with_and_says_so(tmp_path, capsys, monkeypatch):
    import autofit.planning.context as context

    monkeypatch.setattr(context, "timing_threads", lambda device: (2, ""))  # a quiet machine now
    model = fresh_model()
    plan = replace(make_plan(model), measured=_measured(threads=1, noise=0.04))
    seen = []

    def loss_fn(output, target):
        seen.append(torch.get_num_threads())
        return nn.functional.cross_entropy(output, target)

    torch.set_num_threads(2)
    run_training(
        model, plan=plan, data=make_data(), source="tests/training/test_loop.py", input_shape=[1, 4, 4], loss_fn=loss_fn,
        build_optimizer=optimizer, settings=TrainSettings(log_dir=tmp_path / "run", epochs=1),
    )
    out = capsys.readouterr().out
    assert set(seen) == {1}
    assert torch.get_num_threads() == 2  # PyTorch's setting is put back
    assert "threads: training with 1 intra-op thread(s), as the plan's speed was timed (PyTorch's default here: 2)" in out
    assert "speed: training " in out and "the plan measured 100.0 samples/s (noise 4%)" in out


def test_data_workers_by_default_take_only_the_cores_the_steps_threads_leave(monkeypatch):
    import autofit.measure.other_work as other_work

    monkeypatch.setattr(other_work, "usable_cores", lambda: 2)
    assert default_workers("cpu", threads=2)[0] == 0  # a worker would take a core from the step (timm: 0.81x against 0.91x)
    assert default_workers("cpu", threads=1)[0] == 1
    assert default_workers("cpu", threads=1, world_size=2)[0] == 0  # two processes' threads take both cores
    assert default_workers("cuda", threads=2)[0] == 1  # the step runs on the card
    monkeypatch.setattr(other_work, "usable_cores", lambda: 16)
    assert default_workers("cpu", threads=8)[0] == 4 and default_workers("cuda", threads=8)[0] == 4


def test_training_without_workers_given_decides_them_and_says_so(tmp_path, capsys, monkeypatch):
    import autofit.measure.other_work as other_work

    monkeypatch.setattr(other_work, "usable_cores", lambda: torch.get_num_threads())
    model = fresh_model()
    run_training(
        model, plan=make_plan(model), data=make_data(), source="tests/training/test_loop.py", input_shape=[1, 4, 4],
        loss_fn=nn.functional.cross_entropy, build_optimizer=optimizer,
        settings=TrainSettings(log_dir=tmp_path / "run", epochs=1, num_workers=None),
    )
    assert "data: 0 DataLoader worker(s) beside the step" in capsys.readouterr().out


def test_a_plan_without_threads_decides_them_with_the_planners_rule(monkeypatch):
    import autofit.planning.context as context

    monkeypatch.setattr(context, "timing_threads", lambda device: (1, "the machine was busy (load 3 on 2 cores)"))
    torch.set_num_threads(2)
    count, line = threads_for(replace(make_plan(fresh_model()), measured=_measured()))
    assert count == 1 and "decided now: the machine was busy (load 3 on 2 cores)" in line


def test_a_machine_busier_than_while_planning_trains_with_fewer_threads(monkeypatch):
    import autofit.planning.context as context

    monkeypatch.setattr(context, "timing_threads", lambda device: (1, "the machine was busy (load 3 on 2 cores)"))
    torch.set_num_threads(2)
    count, line = threads_for(replace(make_plan(fresh_model()), measured=_measured(threads=2)))
    assert count == 1 and "fewer than the 2 the plan's speed was timed with: the machine was busy (load 3 on 2 cores)" in line
    # never more than the plan timed with, however quiet the machine is now
    monkeypatch.setattr(context, "timing_threads", lambda device: (2, ""))
    assert threads_for(replace(make_plan(fresh_model()), measured=_measured(threads=1)))[0] == 1


def test_a_plan_for_a_gpu_keeps_pytorchs_threads():
    plan = make_plan(fresh_model())
    plan = replace(plan, device=replace(plan.device, type="cuda"), measured=_measured(threads=1))
    assert threads_for(plan) == (torch.get_num_threads(), "")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _steps(speed: StepSpeed, clock: FakeClock, *, wait: float, step: float, count: int, samples: int = 10) -> None:
    for _ in range(count):
        clock.now += wait
        speed.batch_ready()
        clock.now += step
        speed.step_done(samples)


def test_a_step_the_budget_watch_tracked_is_not_timed():
    clock = FakeClock()
    speed = StepSpeed(clock)
    speed.start(warm_up=True)
    _steps(speed, clock, wait=0.0, step=5.0, count=1)  # warm-up
    clock.now += 3.0  # the tracker's bookkeeping makes this step slow
    speed.batch_ready()
    speed.step_done(10, counted=False)
    _steps(speed, clock, wait=0.0, step=0.1, count=2)
    assert speed.samples == [10, 10] and speed.samples_per_s() == pytest.approx(100.0)


def test_the_speed_lines_compare_with_the_plan_and_warn_beyond_its_noise():
    clock = FakeClock()
    speed = StepSpeed(clock)
    speed.start(warm_up=True)
    _steps(speed, clock, wait=5.0, step=5.0, count=1)  # the warm-up step is not counted
    _steps(speed, clock, wait=0.0, step=0.1, count=5)  # 100 samples/s
    plan = replace(make_plan(fresh_model()), measured=_measured(noise=0.05))
    lines = speed.lines(plan)
    assert lines == [
        "speed: training 100.0 samples/s (median of 5 step(s) by the wall clock, the wait for data included), the plan measured "
        "100.0 samples/s (noise 5%): 1.00x"
    ]
    slow = replace(plan, measured=_measured(noise=0.05, samples_per_s=200.0))
    assert speed.lines(slow)[1].startswith(
        "warning: training ran slower than the plan measured, by more than the plan's noise and the loop's own work allow (50% > 10%)"
    )
    noisy = replace(plan, measured=_measured(noise=0.6, samples_per_s=200.0))
    assert len(speed.lines(noisy)) == 1  # within a noisy plan's noise
    near = replace(plan, measured=_measured(noise=0.01, samples_per_s=108.0))
    assert len(speed.lines(near)) == 1  # 7% slower: the loop's own work, no warning
    text = replace(plan, model=replace(plan.model, seq_len=8))
    # in the epoch lines' unit, tokens/s beside it (the epochs said 465 samples/s, the last line 13215.7 tokens/s)
    assert "training 100.0 samples/s (800.0 tokens/s)" in speed.lines(text)[0]
    assert "the plan measured 100.0 samples/s (800.0 tokens/s)" in speed.lines(text)[0]


def test_a_run_waiting_on_its_data_says_so():
    clock = FakeClock()
    speed = StepSpeed(clock)
    speed.start(warm_up=True)
    _steps(speed, clock, wait=0.3, step=0.1, count=4)
    lines = speed.lines(replace(make_plan(fresh_model()), measured=_measured(noise=0.05)))
    assert lines[-1].startswith("data loading bounds the speed: 0.9 s waiting on the DataLoader vs 0.3 s in the steps (75% of the time)")


def test_threads_and_noise_survive_the_plan_file_and_are_checked(tmp_path):
    plan = replace(make_plan(fresh_model()), measured=_measured(threads=1, noise=0.03))
    loaded = load_plan(save_plan(plan, tmp_path / "plan.json"))
    assert (loaded.measured.threads, loaded.measured.noise) == (1, 0.03)
    data = plan.to_dict()
    data["measured"]["threads"] = 0
    with pytest.raises(UserError, match="field measured.threads is 0, expected a whole number"):
        plan_from_dict(data)
    data["measured"].pop("threads")  # an older plan: still loads, nothing recorded
    assert plan_from_dict(data).measured.threads is None


def test_a_plan_timed_by_cpu_time_is_compared_by_cpu_time():
    """One thread on a busy CPU: the plan timed its steps by their CPU time, so the run times its steps by theirs, every
    figure alike (one clock, said once: no wall-clock figure beside it to contradict it)."""
    clock, cpu = FakeClock(), FakeClock()
    plan = replace(make_plan(fresh_model()), measured=_measured(threads=1, noise=0.05))
    speed = StepSpeed(clock, cpu, by_cpu=StepSpeed.for_plan(plan).by_cpu)
    speed.start(warm_up=True)
    for _ in range(4):  # the other work holds the core half the time: 0.2 s of wall clock, 0.1 s of CPU
        speed.batch_ready()
        clock.now += 0.2
        cpu.now += 0.1
        assert speed.step_done(10) == pytest.approx(0.1)  # the step lines' and the bar's figure: the same clock
    assert speed.lines(plan) == [
        "speed: training 100.0 samples/s (median of 3 step(s) by the step's CPU time, as the plan timed it (one thread), "
        "reading the batch included), the plan measured 100.0 samples/s (noise 5%): 1.00x"
    ]
    two_threads = replace(plan, measured=_measured(threads=2, noise=0.05))
    assert not StepSpeed.for_plan(two_threads).by_cpu


def test_every_figure_of_a_run_is_one_speed(tmp_path, capsys):
    """A run of one epoch: its epoch line, its metrics and its last line give the same samples/s (the median step by
    the plan's clock), and one line says which clock."""
    import json

    model = fresh_model()
    plan = replace(make_plan(model), measured=_measured(threads=1, noise=0.04))
    run_training(
        model, plan=plan, data=make_data(), source="tests/training/test_loop.py", input_shape=[1, 4, 4],
        loss_fn=nn.functional.cross_entropy, build_optimizer=optimizer, settings=TrainSettings(log_dir=tmp_path / "run", epochs=1),
    )
    out = capsys.readouterr().out
    assert "speed: every samples/s below is the median step by the step's CPU time, as the plan timed it (one thread)" in out
    epoch = next(json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"epoch"' in line
                 and json.loads(line)["kind"] == "epoch")
    final = float(out.split("speed: training ")[1].split(" samples/s")[0])
    assert f"({epoch['samples_per_s']:.0f} samples/s)" in out
    assert final == pytest.approx(epoch["samples_per_s"], abs=0.05)
    assert "by the wall clock" not in out


def test_the_wait_is_the_loaders_not_the_loops_own_work():
    clock = FakeClock()
    speed = StepSpeed(clock)

    def loader():
        for _ in range(3):
            clock.now += 0.5  # the DataLoader's wait
            yield 10

    speed.start(warm_up=True)
    for samples in speed.timed(loader()):
        clock.now += 0.1  # the step
        speed.step_done(samples)
        clock.now += 0.4  # logging, the gauge: the loop's own work, not the data's
    assert speed.wait_seconds == [0.5, 0.5] and speed.total_seconds == [1.0, 1.0]
    assert speed.samples_per_s() == 10.0
