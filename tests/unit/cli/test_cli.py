"""The infermesh CLI without a mesh: rendering, completion, argument and file errors."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from services.cli import main as cli
from services.cli.render import Answer, format_uptime, render_json, render_text, table
from services.common import admin

REPORT = admin.StatusReport(
    service="scheduler", version="0.1.0", uptime_s=3725.0,
    facts=admin.facts({"tls": "mTLS", "draining": False}),
    sections=(admin.section("workers", ("worker_id", "state", "slots", "kv_usage"),
                            [("w-1", "ready", 8, 0.25), ("worker-22", "draining", 32, 0.5)]),
              admin.section("models", ("model",), [])),
)


def test_table_aligns_text_left_and_numbers_right():
    assert table(("id", "slots"), [("a", 8), ("bbb", 32)]) == [
        "  id   slots", "  ---  -----", "  a        8", "  bbb     32"]


def test_text_shows_each_target_its_facts_and_tables():
    text = render_text([Answer("10.0.0.1:50052", REPORT), Answer("10.0.0.2:50052", error_code="PERMISSION_DENIED",
                                                                  error_message="peer x may not call")])
    assert text.splitlines()[:3] == ["scheduler 10.0.0.1:50052  version 0.1.0  up 1h02m",
                                     "  tls       mTLS", "  draining  no"]
    assert "    worker-22  draining     32       0.5" in text
    assert "  models: none" in text
    assert text.endswith("10.0.0.2:50052  ERROR PERMISSION_DENIED: peer x may not call")


def test_json_keeps_types_and_errors_per_target():
    data = json.loads(render_json([Answer("a:1", REPORT), Answer("b:2", error_code="UNAVAILABLE", error_message="down")]))
    first, second = data["services"]
    assert (first["target"], first["draining"], first["workers"][1]["slots"]) == ("a:1", False, 32)
    assert second == {"target": "b:2", "error": {"code": "UNAVAILABLE", "message": "down"}}


@pytest.mark.parametrize(("seconds", "text"), [(5, "5s"), (65, "1m05s"), (7260, "2h01m"), (90000, "1d1h")])
def test_uptime_reads_at_a_glance(seconds, text):
    assert format_uptime(seconds) == text


def test_bash_completion_knows_subcommands_flags_and_choices():
    script = cli.completion.script(cli.build_parser(), "bash")
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert "compgen -W 'status classify generate rollout models completion" in script
    assert "compgen -W 'pause resume abort promote'" in script
    assert "--scheduler" in script and "--max-tokens" in script
    assert "compgen -W 'bash zsh'" in script
    assert "bashcompinit" in cli.completion.script(cli.build_parser(), "zsh")


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["classify", "x.png"])  # no --model
    assert exc.value.code == 2
    assert cli.main(["classify", "/nonexistent.png", "--model", "m"]) == 2
    assert "cannot read image /nonexistent.png" in capsys.readouterr().err
    assert cli.main(["status", "--gateway", "", "--cert-file", "c.pem", "--key-file", "k.pem", "--scheduler", "a:1"]) == 2
    assert "--cert-file needs --ca-file" in capsys.readouterr().err
    assert cli.main(["status", "--gateway", ""]) == 2


def test_npy_images_go_raw_and_must_be_uint8(tmp_path):
    good, bad = tmp_path / "good.npy", tmp_path / "bad.npy"
    np.save(good, np.zeros((8, 6, 3), dtype=np.uint8))
    np.save(bad, np.zeros((8, 6), dtype=np.float32))
    image = cli.image_of(str(good))
    assert (image.raw.height, image.raw.width, image.raw.channels, len(image.raw.pixels)) == (8, 6, 3, 144)
    with pytest.raises(cli.UsageError, match="need a uint8 array"):
        cli.image_of(str(bad))


def test_api_key_flag_then_file_then_environment(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    monkeypatch.setenv(cli.API_KEY_ENV, "sk-from-env")
    args = cli.build_parser().parse_args(["status"])
    assert cli.api_key(args) == "sk-from-env"
    args = cli.build_parser().parse_args(["status", "--api-key-file", str(key_file)])
    assert cli.api_key(args) == "sk-from-file"
    args = cli.build_parser().parse_args(["status", "--api-key", "sk-flag", "--api-key-file", str(key_file)])
    assert cli.metadata(args) == (("authorization", "Bearer sk-flag"),)


def test_rollout_takes_an_action_and_a_model_and_refuses_other_actions(capsys):
    args = cli.build_parser().parse_args(["rollout", "pause", "digits", "--gateway", "127.0.0.1:1"])
    assert (args.command, args.action, args.model) == ("rollout", "pause", "digits")
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["rollout", "rewind", "digits"])
    assert exited.value.code == 2
