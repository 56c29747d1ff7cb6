"""``EngineArgs``: ``LLM()``'s options as a dataclass and as vLLM's command-line flags; the
fields are ``model``, every ``Config`` option, then vLLM's of ``entrypoints/options.py``."""

import argparse
import json
from dataclasses import dataclass, field, fields, make_dataclass

from nanovllm.config import CHOICES, Config
from nanovllm.entrypoints.options import ALIASES, OPTIONS

TRI_STATE = ("enable_chunked_prefill",)  # None, or a flag: --enable-chunked-prefill / --no-...


def _value(text: str):
    """A flag whose default is None: JSON (``{"key": 1}``, ``3``, ``null``), else the text."""
    if text == "None":
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _int(text: str) -> int | None:
    return None if text == "None" else int(text)


class _EngineArgs:
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One flag per field, spelled as vLLM spells it (``--max-model-len``); booleans as
        ``--enforce-eager`` / ``--no-enforce-eager``."""
        group = parser.add_argument_group("engine options (LLM(...) keywords)")
        group.add_argument("--model", type=str, default=None, help="a local model folder")
        for f in fields(EngineArgs)[1:]:
            flag, default = "--" + f.name.replace("_", "-"), f.default
            kind = {"default": default, "help": f"default: {default!r}"}
            if isinstance(default, bool) or f.name in TRI_STATE:
                kind["action"] = argparse.BooleanOptionalAction
            elif f.name in CHOICES:
                kind["choices"] = CHOICES[f.name]
            else:
                types = {int: _int, float: float, str: str}
                kind["type"] = types.get(type(default), _value)
            group.add_argument(flag, **kind)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace):
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def llm_kwargs(self) -> dict:
        """``LLM()``'s keywords: every ``Config`` option, and vLLM's that are not at default."""
        names = Config.field_names()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name in names or getattr(self, f.name) != f.default
        }


def _fields() -> list:
    out = [(f.name, f.type, field(default=f.default)) for f in fields(Config) if f.init]
    out[0] = ("model", str)
    out += [(name, object, field(default=None)) for name in ALIASES]
    vllm = [(name, object, field(default=d)) for name, (d, _) in OPTIONS.items()]
    return out + [f for f in vllm if f[0] not in Config.field_names()]  # a Config field wins


EngineArgs = make_dataclass("EngineArgs", _fields(), bases=(_EngineArgs,))
EngineArgs.__module__ = __name__
EngineArgs.__doc__ = "``LLM()``'s keywords as a dataclass: ``LLM.from_engine_args(args)``."


@dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the options of an asynchronous engine: the same options here."""


def from_engine_args(cls, engine_args: EngineArgs):
    """``cls(**options)``: ``LLM.from_engine_args`` and ``LLMEngine.from_engine_args``."""
    if not isinstance(engine_args, EngineArgs):
        got = type(engine_args).__name__
        raise TypeError(f"from_engine_args takes an EngineArgs, got {got}")
    return cls(**engine_args.llm_kwargs())
