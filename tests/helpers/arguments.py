"""Flags checked in this process, exactly as pretrain_gpt.py checks them before any collective."""
import pytest

from megatron.arguments import parse_args


def one_line_exit_2(argv, world_size, monkeypatch, capsys):
    """parse_args(argv) as global rank 0 of `world_size` ranks must exit 2; returns its one stderr line."""
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        parse_args([str(a) for a in argv], world_size=world_size)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]
