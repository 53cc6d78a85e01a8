"""``--help`` of the argparse commands: every option's default, none where there is none."""

from __future__ import annotations

import argparse


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help (not for required options or ``None`` defaults); the
    description and epilog as written (the run keys' table)."""

    def _get_help_string(self, action):
        if action.default is None or action.required or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)
