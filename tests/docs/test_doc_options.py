"""Every option the docs' synopses give a command is one that command takes: a synopsis
(```text blocks of ``fp8ray CMD ...`` lines) is what a reader copies from."""

from __future__ import annotations

import argparse
import re

from test_doc_paths import DOCS

from fp8ray.cli import build_parser

FENCE = re.compile(r"```text\n(.*?)```", re.S)
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (group,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return group.choices


def command_of(words: list[str], parser: argparse.ArgumentParser) -> tuple[str, argparse.ArgumentParser]:
    """The (sub)command a synopsis line names (``fp8ray bench codec``), and its parser."""
    names = []
    while words and not words[0].startswith("-") and any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
        choices = subcommands(parser)
        assert words[0] in choices, f"a synopsis names command 'fp8ray {' '.join([*names, words[0]])}', which is none"
        parser = choices[words[0]]
        names.append(words.pop(0))
    return " ".join(names), parser


def synopsis_options(text: str) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """``(command, --option)`` for every option in a synopsis: a line ``fp8ray CMD ...``
    starts a command; an indented line goes on with the one before; a line ``(both) ...``
    holds options of every command of its block."""
    found = []
    root = build_parser()
    for block in FENCE.findall(text):
        commands: list[tuple[str, argparse.ArgumentParser]] = []
        for line in block.splitlines():
            if line.startswith("fp8ray "):
                commands.append(command_of(line.split()[1:], root))
                at = commands[-1:]
            elif line.startswith("(both)"):
                at = commands
            elif not (line.startswith(" ") and commands):
                commands, at = [], []
                continue
            found += [(name, option, parser) for name, parser in at for option in OPTION.findall(line)]
    return found


def takes(parser: argparse.ArgumentParser, option: str) -> bool:
    return option in parser._option_string_actions


def test_the_synopses_are_found_and_read():
    text = "```text\nfp8ray verify ARCHIVE [--against SRC]\n               [--nope]\nnot a command --json\n```"
    found = [(name, option, takes(parser, option)) for name, option, parser in synopsis_options(text)]
    assert found == [("verify", "--against", True), ("verify", "--nope", False)]


def test_every_option_a_synopsis_gives_a_command_is_one_it_takes():
    found = [(doc.name, *entry) for doc in DOCS for entry in synopsis_options(doc.read_text())]
    assert len({name for _, name, _, _ in found}) >= 8, found  # the synopses are still read
    wrong = [f"{doc}: fp8ray {name} {option}" for doc, name, option, parser in found if not takes(parser, option)]
    assert not wrong, wrong
