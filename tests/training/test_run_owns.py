"""What a run owns and the data it started with (#53): a finished run resumed rewrites nothing, hf/ keeps the files
the run did not write, --merge is recorded, an interrupted --overwrite resumes the earlier run, and a resume over
changed data is refused unless asked for."""
import errno
import shutil

import pytest

from autofit.training.loop import TrainSettings
from autofit.training.resume import read_saved_run
from autofit.training.rundir import LOCK_FILE, start_fresh
from tests.helpers import main_exit_code
from tests.helpers.images import train_args


@pytest.fixture(scope="module")
def finished(tmp_path_factory, project):
    """A run of the tiny image project that trained its one epoch; copy it before changing it."""
    log_dir = tmp_path_factory.mktemp("finished") / "run"
    assert main_exit_code(*train_args(project, log_dir, "--epochs", "1")) == 0
    return log_dir


def _files(folder) -> dict:
    return {p.relative_to(folder): (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*") if p.name != LOCK_FILE}


def test_resuming_a_finished_run_says_so_in_one_line_and_rewrites_nothing(finished, tmp_path, run_cli):
    log_dir = tmp_path / "run"
    shutil.copytree(finished, log_dir)
    before = _files(log_dir)
    code, out, err = run_cli("train", "--log-dir", log_dir, "--resume")
    assert code == 0 and err == ""
    assert out.strip().splitlines() == [out.strip()] and "is finished (1 epoch(s), 3 steps)" in out and "--epochs above 1" in out
    assert _files(log_dir) == before
    from autofit.training.resume import finished_run

    assert finished_run(log_dir, epochs=None) is not None and finished_run(log_dir, epochs=2) is None
    assert finished_run(log_dir, epochs=None, merge=True) is None  # --merge asked now: hf/merged is left to write


def test_resume_after_an_overwrite_killed_before_its_first_save_continues_the_earlier_run(finished, tmp_path):
    """kill -9 of an --overwrite run before it saved: the earlier run waits in .previous/, and --resume said last.pt
    did not exist (its advice, --overwrite, would have deleted it)."""
    log_dir = tmp_path / "run"
    shutil.copytree(finished, log_dir)
    start_fresh(log_dir, overwrite=True)  # what the killed run did first
    assert not (log_dir / "last.pt").exists()
    saved = read_saved_run(log_dir)
    assert saved["position"]["global_step"] == 3 and (log_dir / "last.pt").is_file() and not (log_dir / ".previous").exists()


def test_resume_over_changed_data_is_refused_unless_asked_for(finished, project, tmp_path, run_cli):
    log_dir = tmp_path / "run"
    shutil.copytree(finished, log_dir)
    (project / "data" / "train" / "a" / "0.png").rename(tmp_path / "moved.png")  # half an image folder deleted, in small
    try:
        code, _, err = run_cli("train", "--log-dir", log_dir, "--resume", "--epochs", "2", "--workers", "0")
        assert code == 2 and "changed since the run in" in err and "23 train" in err and "--data-changed" in err
        assert len(err.strip().splitlines()) == 1
        code, out, err = run_cli("train", "--log-dir", log_dir, "--resume", "--epochs", "2", "--workers", "0", "--data-changed")
        assert code == 0, err
        assert "training goes on over it, as --data-changed asks" in out
    finally:
        (tmp_path / "moved.png").rename(project / "data" / "train" / "a" / "0.png")


def test_merge_is_a_setting_the_run_records_and_a_resume_keeps():
    """A resumed --merge run wrote hf/ without merged/: --merge was not among the settings last.pt records."""
    recorded = TrainSettings(merge=True).for_new_run().record()
    assert recorded["merge"] is True
    assert TrainSettings(resume=True).for_resume(recorded, global_step=3).merge is True
    assert TrainSettings(resume=True).for_resume({}, global_step=3).merge is False


def test_hf_save_replaces_only_its_own_files_and_a_full_disk_under_safetensors_is_an_oserror(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors")
    from autofit.training.hf_export import save_for_transformers
    from autofit.training.rundir import remove_leftovers

    config = transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=16, max_position_embeddings=8)
    model = transformers.LlamaForCausalLM(config)
    hf = tmp_path / "hf"
    (hf / "merged").mkdir(parents=True)
    (hf / "README.md").write_text("my model card")
    (hf / "merged" / "config.json").write_text("{}")
    (hf / "config.json").write_text("old")
    save_for_transformers(model, log_dir=tmp_path)
    assert (hf / "README.md").read_text() == "my model card" and (hf / "merged" / "config.json").read_text() == "{}"
    assert (hf / "config.json").read_text() != "old" and (hf / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    # Killed after the save was whole, before every file was moved: the next run in the folder finishes the move.
    (tmp_path / "hf.partial").mkdir()
    (tmp_path / "hf.partial" / "config.json").write_text("new")
    (tmp_path / "hf.partial" / ".complete").touch()
    remove_leftovers(tmp_path)
    assert (hf / "config.json").read_text() == "new" and (hf / "README.md").is_file() and not (tmp_path / "hf.partial").exists()

    def full(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", full)
    with pytest.raises(OSError) as error:
        save_for_transformers(model, log_dir=tmp_path)
    assert error.value.errno == errno.ENOSPC
    assert (hf / "config.json").read_text() == "new" and not (tmp_path / "hf.partial").exists()


def test_a_full_disk_line_is_the_same_for_a_safetensors_write():
    from autofit.training.weights import disk_full

    safetensors = pytest.importorskip("safetensors")
    assert disk_full(safetensors.SafetensorError("I/O error: Disk quota exceeded (os error 122)"), "hf").errno == errno.EDQUOT
    assert disk_full(safetensors.SafetensorError("invalid header"), "hf") is None


def test_the_data_fingerprint_leaves_out_a_run_folder_inside_the_data(tmp_path):
    from autofit.training.resume import data_fingerprint

    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "x.png").write_bytes(b"12")
    before = data_fingerprint(tmp_path, samples={"train": 1, "val": 0}, log_dir=tmp_path / "runs" / "a")
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "last.pt").write_bytes(b"saved")
    assert data_fingerprint(tmp_path, samples={"train": 1, "val": 0}, log_dir=tmp_path / "runs" / "a") == before
    assert before["files"] == 1 and before["bytes"] == 2


def test_fit_resuming_a_finished_run_prints_its_one_line_and_returns_the_run_s_result(tmp_path, capsys):
    import autofit
    from tests.helpers.training import fresh_model, make_data, make_plan, optimizer

    data, model = make_data(), fresh_model()
    autofit.fit(model, train_data=data.train, val_data=data.val, plan=make_plan(model), optimizer=optimizer,
                log_dir=tmp_path / "run", verbose=False)
    before = _files(tmp_path / "run")
    capsys.readouterr()
    result = autofit.fit(fresh_model(), train_data=data.train, val_data=data.val, optimizer=optimizer, log_dir=tmp_path / "run",
                         resume=True)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "is finished (1 epoch(s), 5 steps)" in out and "give epochs above 1" in out
    assert len(result.history) == 1 and result.best_path == tmp_path / "run" / "best.pt"
    assert _files(tmp_path / "run") == before


def test_overwrite_sets_aside_and_deletes_only_the_files_the_run_wrote_in_hf(tmp_path):
    """--overwrite moved the whole hf/ aside and deleted it after the new run's first save, a model card with it."""
    from autofit.training.rundir import discard_previous_run, restore_previous_run

    hf = tmp_path / "hf"
    (hf / "merged").mkdir(parents=True)
    (hf / "README.md").write_text("my model card")
    (hf / "config.json").write_text("{}")
    (hf / "merged" / "model.safetensors").write_bytes(b"w")
    (hf / ".autofit-files.json").write_text('["config.json", "merged/model.safetensors"]')
    (tmp_path / "last.pt").write_bytes(b"earlier")
    start_fresh(tmp_path, overwrite=True)
    assert sorted(p.name for p in hf.iterdir()) == ["README.md"]
    restore_previous_run(tmp_path)  # the new run failed before its first save
    assert (hf / "config.json").is_file() and (hf / "merged" / "model.safetensors").is_file() and (hf / "README.md").is_file()
    start_fresh(tmp_path, overwrite=True)
    discard_previous_run(tmp_path)  # the new run saved
    assert sorted(p.name for p in hf.iterdir()) == ["README.md"] and (hf / "README.md").read_text() == "my model card"
