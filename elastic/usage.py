"""The command lines' shared parts (elasticrun, elasticctl): a mistake is one
UsageError (one line, exit 2, never argparse's usage dump and exit), and a parser
keeps a public table of its flags, so that code turning options into flags
(elastic.launch, the Ray executor, --config-file, splitting off the training
command) never reads argparse's internals.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, NoReturn

from elastic.exceptions import ElasticError

_SWITCHES = ("store_true", "store_false", "store_const", "count", "help", "version")


class UsageError(ElasticError):
    """A bad command line or option: the message is the one line the user sees."""


@dataclass(frozen=True)
class Flag:
    """One flag of a parser, as written on the command line."""

    names: tuple[str, ...]    # its option strings, e.g. ("-np", "--num-proc")
    dest: str                 # where the parsed value goes
    nargs: int | None         # words after it: 0 (a switch), N, or None (one)
    repeatable: bool          # may be given again, each adding a value (--ssh-option)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises UsageError and lists its flags in ``flags``
    (option string -> Flag), those of its argument groups included."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.flags: dict[str, Flag] = {}      # first: argparse adds --help while it starts
        super().__init__(*args, **kwargs)

    def add_argument(self, *names: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*names, **kwargs)
        self._record(action, kwargs)
        return action

    def add_argument_group(self, *args: Any, **kwargs: Any) -> Any:
        group = super().add_argument_group(*args, **kwargs)
        add = group.add_argument

        def add_and_record(*names: Any, **kw: Any) -> argparse.Action:
            action = add(*names, **kw)
            self._record(action, kw)
            return action

        group.add_argument = add_and_record   # type: ignore[method-assign]
        return group

    def _record(self, action: argparse.Action, kwargs: dict[str, Any]) -> None:
        if not action.option_strings:
            return                                          # a positional argument
        kind = kwargs.get("action")
        nargs = 0 if kind in _SWITCHES else kwargs.get("nargs")
        flag = Flag(tuple(action.option_strings), action.dest,
                    nargs if isinstance(nargs, int) else None, kind == "append")
        for name in flag.names:
            self.flags[name] = flag

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)
