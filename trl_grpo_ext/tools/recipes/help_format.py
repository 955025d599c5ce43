"""The recipe's `--help` and `--help-all`: each field under its own name, `--help` showing first sentences.

`RecipeParser` (`recipes.arguments`) formats its help with these; `--help-all` prints every help text whole.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap

__all__ = ["HelpAllAction", "HelpFormatter", "ShortHelpFormatter"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each field under its name only (`--learning_rate`, not also `--learning-rate`, which parses all the same)."""

    def _format_action_invocation(self, action) -> str:
        if not action.option_strings or action.dest == "help":
            return super()._format_action_invocation(action)
        if action.nargs == 0:
            return action.option_strings[0]
        metavar = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{action.option_strings[0]} {metavar}"


#: The end of a help text's first sentence: a period after a word, then a capital (not "e.g. 'main'").
_SENTENCE_END = re.compile(r"(?<=[\w)`'\]])\.\s+(?=[A-Z])")


class ShortHelpFormatter(HelpFormatter):
    """`--help`'s: a field on one line when it fits, else the flag on its line and, below it, its help text's first
    sentence, whole, wrapped to the terminal and indented, then its default. `--help-all` shows every help text
    whole."""

    def _format_action_invocation(self, action) -> str:
        if not action.option_strings or action.dest == "help":
            return super()._format_action_invocation(action)
        flag = action.option_strings[0]
        choices = f" {{{','.join(map(str, action.choices))}}}" if action.choices else ""
        return flag + choices if self._current_indent + len(flag + choices) <= self._width else flag

    def _format_action(self, action) -> str:
        indent = " " * self._current_indent
        flag, summary = self._format_action_invocation(action), self._summary(action)
        if len(f"{indent}{flag}  {summary}") <= self._width:
            return f"{indent}{flag}  {summary}\n"
        # At least 40 columns of text, however narrow the terminal, so that a sentence is not one word a line.
        lines = textwrap.wrap(summary, max(self._width - len(indent) - 4, 40), break_on_hyphens=False)
        return f"{indent}{flag}\n" + "".join(f"{indent}    {line}\n" for line in lines)

    def _summary(self, action) -> str:
        """The help text's first sentence, whole, and the default."""
        text, default = self._expand_help(action), f" (default: {action.default})"
        text, default = (text.removesuffix(default), default) if text.endswith(default) else (text, "")
        sentences = _SENTENCE_END.split(text, maxsplit=1)
        return sentences[0] + ("." if len(sentences) > 1 else "") + default


class HelpAllAction(argparse.Action):
    """`--help-all`: print the help of every field, in full, and exit."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(parser.format_help(full=True))
        parser.exit()
