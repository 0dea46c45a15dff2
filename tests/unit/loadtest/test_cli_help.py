"""Every loadtest option explains itself: help text that states its default."""

from __future__ import annotations

import argparse

import pytest

from loadtest.cli import _parser


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_option_has_help_that_states_its_default(command):
    parser = _subcommands()[command]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.dest}: no help"
        if action.option_strings:  # positionals have no default to state
            assert "default" in action.help, f"{command} {'/'.join(action.option_strings)}: help names no default"


def test_help_renders_literal_defaults():
    text = _subcommands()["run"].format_help()
    assert "(default: reports)" in text and "(default: json,md,html)" in text
