"""One command line: ``ascend-vlm`` and ``python -m ascend_vlm`` are one program, every
option explains itself and shows its default, ``--version`` answers."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_vlm.__main__ import build_parser, main
from ascend_vlm._version import __version__


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


SUBCOMMANDS = _subcommands()


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_option_has_help_and_shows_its_default(name):
    parser = SUBCOMMANDS[name]
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{name} {action.option_strings[0]}: no help text"
        value = action.default
        if action.nargs != 0 and value not in (None, "", [], ()) and "default" not in action.help:
            assert f"(default: {value})" in text, f"{name} {action.option_strings[0]}"


def test_defaults_shown_are_the_real_ones():
    text = " ".join(SUBCOMMANDS["generate-batch"].format_help().split())
    assert "--max-batch-size MAX_BATCH_SIZE sequences running at once (default: 16)" in text
    assert "--no-progress no progress bar" in text  # flags say nothing about defaults


def test_on_off_pairs_name_the_default_flag():
    for name, parser in SUBCOMMANDS.items():
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if isinstance(action, argparse.BooleanOptionalAction) and "default" not in action.help:
                flag = action.option_strings[0 if action.default else 1]
                assert f"(default: {flag})" in text, f"{name} {action.option_strings[0]}"
    text = " ".join(SUBCOMMANDS["generate-batch"].format_help().split())
    assert "same images, same adapter) (default: --prefix-cache)" in text


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"ascend_vlm {__version__}\n"


def test_the_console_script_is_the_same_program():
    script = shutil.which("ascend-vlm", path=str(Path(sys.executable).parent))
    assert script is not None, "ascend-vlm: expected beside this Python (pip install -e .)"
    result = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == f"ascend_vlm {__version__}\n"
    result = subprocess.run([script, "demo", "--max-new-tokens", "0"], capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "ascend-vlm demo: error: --max-new-tokens: expected >= 1, got 0"
    )
    assert "Traceback" not in result.stderr
