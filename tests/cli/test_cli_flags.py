"""One meaning per short flag: `-b` is `--budget` in every command that has it, never another option."""
from collections import defaultdict

import typer

from autofit.cli import app


def _flags_by_command() -> dict[str, list[tuple[str, list[str]]]]:
    """command name -> [(a long name, its short names)] for every option."""
    group = typer.main.get_command(app)
    found = {}
    for name, command in group.commands.items():
        options = []
        for param in command.params:
            names = [*param.opts, *param.secondary_opts]
            long = [n for n in names if n.startswith("--")]
            short = [n for n in names if not n.startswith("--")]
            if long:
                options.append((long[0], short))
        found[name] = options
    return found


def test_each_short_flag_means_one_long_option_in_every_command():
    meanings = defaultdict(set)  # "-b" -> {"--budget"}
    for command, options in _flags_by_command().items():
        for long, shorts in options:
            for short in shorts:
                meanings[short].add(long)
    assert meanings, "no short flags found: the walk over the app's commands found nothing"
    assert {short: longs for short, longs in meanings.items() if len(longs) > 1} == {}


def test_each_long_option_has_one_short_flag_everywhere():
    shorts_of = defaultdict(set)  # "--batch-size" -> {"-n"}
    for command, options in _flags_by_command().items():
        for long, shorts in options:
            shorts_of[long].update(shorts)
    assert {long: shorts for long, shorts in shorts_of.items() if len(shorts) > 1} == {}


def test_plan_and_compare_share_budget_and_batch_size_flags():
    options = _flags_by_command()
    for command in ("plan", "compare"):
        flags = dict(options[command])
        assert flags["--budget"] == ["-b"], command
        assert flags["--batch-size"] == ["-n"], command


def test_every_command_with_progress_lines_takes_quiet():
    """The README: `-q` is quiet in every command; those that write progress lines or a progress bar take it."""
    options = _flags_by_command()
    for command in ("probe", "plan", "compare", "train"):
        assert dict(options[command]).get("--quiet") == ["-q"], command



def test_plan_help_is_grouped_into_panels():
    """`plan --help` was 28 options in one list: each is now in one of its panels, and an option plan shares with
    other commands (--input-shape) is grouped in plan's help only."""
    group = typer.main.get_command(app)
    panels = {param.name: getattr(param, "rich_help_panel", None) for param in group.commands["plan"].params}
    assert set(panels.values()) == {
        "Arguments", "Model", "Budget and batch", "Search", "A device that is not here", "Fine-tuning", "Output",
    }
    assert (panels["budget"], panels["device_kind"], panels["lora"], panels["out"]) == (
        "Budget and batch", "A device that is not here", "Fine-tuning", "Output",
    )
    assert {param.name: getattr(param, "rich_help_panel", None) for param in group.commands["probe"].params}["input_shape"] is None
