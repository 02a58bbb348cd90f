"""`embodied-kv serve` refuses what it cannot serve with exit code 2 and a reason."""

from __future__ import annotations

import socket

from embodied_kv.cli import main


def test_a_config_that_is_not_there(tmp_path, capsys):
    assert main(["serve", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "cannot read config" in capsys.readouterr().err


def test_ar_mode_is_refused(tmp_path, capsys):
    path = tmp_path / "robot.yaml"
    path.write_text("/**:\n  ros__parameters:\n    preset: tiny\n    action_mode: ar\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "action_mode='ar'" in capsys.readouterr().err


def test_a_port_in_use(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--preset", "tiny", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
