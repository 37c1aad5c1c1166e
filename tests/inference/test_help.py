"""`eyas --help` and every subcommand's: a one-line summary, a description, an example of the command itself, and
every option's default shown."""

from __future__ import annotations

import argparse

import pytest

from eyas.inference.cli import build_parser


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, its parser, its one-line help) for every subcommand, nested ones included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield path + (name,), sub, summaries.get(name)
                yield from commands(sub, path + (name,))


ALL = list(commands(build_parser()))


def test_every_command_is_listed():
    names = {" ".join(path) for path, _, _ in ALL}
    assert {"data prepare", "data regenerate", "data vocab", "data cache-hidden", "train", "export", "generate",
            "chat", "bench", "demo"} <= names


@pytest.mark.parametrize("path,parser,summary", ALL, ids=[" ".join(p) for p, _, _ in ALL])
def test_help_has_a_summary_and_an_example_of_the_command(path, parser, summary):
    assert summary and "\n" not in summary and parser.description
    text = parser.format_help()
    assert "example" in text.split("options:")[-1]
    assert f"eyas {' '.join(path)} " in text.split("options:")[-1]  # the example runs this very command


@pytest.mark.parametrize("path,parser,summary", ALL, ids=[" ".join(p) for p, _, _ in ALL])
def test_every_option_with_a_default_shows_it(path, parser, summary):
    formatter = parser._get_formatter()
    for action in parser._actions:
        unset = any(action.default is x for x in (None, False, argparse.SUPPRESS))
        if action.option_strings and not unset:
            assert "default" in formatter._get_help_string(action), (path, action.option_strings)


def test_top_level_help_has_examples():
    text = build_parser().format_help()
    assert "eyas demo --quick" in text and "eyas COMMAND --help" in text
