"""``FlexibleArgumentParser``: vLLM's parser, which takes ``--flag_name`` for ``--flag-name``."""

import argparse
import sys


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that reads underscores in a long flag's name as dashes."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([_dashed(arg) for arg in args], namespace)


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value
