"""One problem found in a config, and the one error that reports all of them.

Validation collects every problem before it raises, so a pasted axolotl config needs one round of
edits, not thirty. Each problem names its key and the fix. A config with one problem gives one
line (as every shardpool error); with several, a header line and one line per problem.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardpool.errors import ShardpoolError

__all__ = ["Problem", "Check", "problems_error"]


@dataclass(frozen=True)
class Problem:
    """What is wrong with one key and how to fix it.

    ``alone`` is the line shown when it is the config's only problem (it names the config file);
    ``listed`` is its line among several, under a header that names the file.
    """

    key: str
    alone: str
    listed: str


@dataclass(frozen=True)
class Check:
    """A rule across keys that a config breaks; ``keys`` are the top-level keys it reads."""

    keys: tuple[str, ...]
    message: str

    def problem(self, source: str, *, prefix: str = "") -> Problem:
        """This check as a problem of the config ``source``; ``prefix`` is the section it is in."""
        if prefix:
            return Problem(prefix, f"{source}: `{prefix}`: {self.message}", f"`{prefix}`: {self.message}")
        return Problem("", f"{source}: {self.message}", self.message)


def problems_error(problems: list[Problem], source: str) -> ShardpoolError:
    """One ShardpoolError that reports every problem: one line alone, else a header and a list."""
    unique = list(dict.fromkeys(problems))
    if len(unique) == 1:
        return ShardpoolError(unique[0].alone)
    lines = [f"{source} has {len(unique)} problems; fix them all, then run again:"]
    lines += [f"  - {problem.listed}" for problem in unique]
    return ShardpoolError("\n".join(lines))
