"""The command line's parts every command shares: the argument parser (one-line errors, the
likely flag for a misspelt one, defaults in the help), the argument types and conventions, and
the checks and writes around a command's inputs and outputs.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from trace_roofline.errors import InputError
from trace_roofline.files import write_files
from trace_roofline.model import formulas

if TYPE_CHECKING:
    from trace_roofline.model.models import ModelSpec

PROG = "trace-roofline"


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's and epilog's lines; appends each option's default to its help
    (an option whose default is None says in its help what happens without it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default not in (None, argparse.SUPPRESS) and action.nargs != 0  # not a switch
                and "%(default)" not in text and "(default:" not in text and action.option_strings):
            shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else "%(default)s"
            text += f" (default: {shown})"
        return text


class Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line (no usage dump) with exit code 2 and shows
    defaults in its help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {_suggested(message)}\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        """argparse's, with the chosen command's parser reporting what it did not recognise,
        each misspelt flag with the one it most likely means."""
        ns, extras = super().parse_known_args(args, namespace)
        command = self._command_parser(ns)
        if extras and command is not None and self is not command:
            command.error("unrecognized arguments: " + " ".join(
                _with_suggestion(x, command._option_string_actions) for x in extras))
        return ns, extras

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error("unrecognized arguments: " + " ".join(
                _with_suggestion(x, self._option_string_actions) for x in extras))
        return ns

    def _command_parser(self, ns: argparse.Namespace) -> argparse.ArgumentParser | None:
        """The parser of the subcommand `ns` names (None without subcommands)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(ns, action.dest or "", None) or "")
        return None


_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")


def did_you_mean(word: str, choices: Sequence[str]) -> str | None:
    """The choice `word` most likely misspells (difflib's closest, cutoff 0.6), else None."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def _with_suggestion(token: str, options: Sequence[str]) -> str:
    """An unrecognised argument, with the flag it likely misspells: "--modle (did you mean
    --model?)"."""
    flag = token.split("=", 1)[0]
    guess = did_you_mean(flag, [o for o in options if o.startswith("--")]) if flag.startswith("-") else None
    return f"{token} (did you mean {guess}?)" if guess else token


def _suggested(message: str) -> str:
    """argparse's message, an invalid choice followed by the choice it most likely misspells."""
    m = _INVALID_CHOICE.search(message)
    if m is None:
        return message
    guess = did_you_mean(m.group(1), re.findall(r"'([^']*)'", m.group(2)))
    return f"{message}; did you mean {guess!r}?" if guess else message


def _ints_at_least(text: str, least: int, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < least for v in values):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return values


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers, e.g. '1,16,64'."""
    return _ints_at_least(text, 1, "positive integers")


def count_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 0, e.g. '0,1024'."""
    return _ints_at_least(text, 0, "integers >= 0")


def name_list(text: str) -> list[str]:
    """argparse type: comma-separated names, e.g. 'h100-sxm,h200'."""
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return values


def positive_int(text: str) -> int:
    """argparse type: one positive integer, e.g. '2'."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def model_arg(text: str) -> str:
    """argparse type for --model: a preset name, a config.json, or a Hugging Face model
    directory (its config.json)."""
    path = Path(text)
    if not path.is_dir():
        return text
    config = path / "config.json"
    if not config.is_file():
        raise argparse.ArgumentTypeError(f"{path}: directory holds no config.json")
    return str(config)


def add_convention_args(p: argparse.ArgumentParser, lesson: bool = False) -> None:
    """--causal / --attention-bytes (and --lesson where the lesson's table is reproducible:
    then both default to None, resolved by `conventions`)."""
    p.add_argument("--causal", choices=formulas.CAUSAL_CONVENTIONS, default=None if lesson else "causal",
                   help="attention FLOPs: every query-key pair (full) or unmasked ones (causal)"
                        + (" (default: causal; full with --lesson)" if lesson else ""))
    p.add_argument("--attention-bytes", choices=formulas.ATTENTION_BYTES_CONVENTIONS,
                   default=None if lesson else "all",
                   help="attention bytes: K,V reads only (kv) or Q,K,V read + O written (all)"
                        + (" (default: all; kv with --lesson)" if lesson else ""))
    if lesson:
        p.add_argument("--lesson", action="store_true",
                       help="the lesson's conventions: --causal full --attention-bytes kv")


def add_force_arg(p: argparse.ArgumentParser, layers: bool = True) -> None:
    p.add_argument("--force", action="store_true",
                   help="analyse traces whose shapes contradict --model (an error otherwise): "
                        + ("warn, and never extrapolate with --layers" if layers else "warn"))


def conventions(args: argparse.Namespace) -> tuple[formulas.Causal, formulas.AttentionBytes]:
    """(causal, attention_bytes) of `intensity`: --lesson's unless a flag contradicts it."""
    if not args.lesson:
        return args.causal or "causal", args.attention_bytes or "all"
    for flag, given, lesson in (("--causal", args.causal, "full"),
                                ("--attention-bytes", args.attention_bytes, "kv")):
        if given not in (None, lesson):
            raise InputError(f"--lesson means {flag} {lesson}; drop --lesson or {flag} {given}")
    return "full", "kv"


def get_model(name: str) -> ModelSpec:
    """model.models.get_model, imported on first use (the model layouts load pandas)."""
    from trace_roofline.model.models import get_model as preset_or_config

    return preset_or_config(name)




# A Hugging Face config.json is a few kB: a JSON file this small without traceEvents is read
# whole to tell a model config given as the trace (no trace is this small and config-like).
_CONFIG_MAX_BYTES = 1 << 20
# Keys every HF config has one of, and no Chrome trace has at its top level.
_CONFIG_KEYS = frozenset({"model_type", "architectures", "hidden_size", "num_hidden_layers",
                          "num_attention_heads", "text_config", "n_embd", "d_model"})


def is_model_config(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a model's config.json: a small JSON object with a config's keys and no
    traceEvents. Only a regular file is opened (never a FIFO or a device), and only a small one."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _CONFIG_MAX_BYTES:
            return False
        with open(path, "rb") as f:
            doc = json.loads(f.read())
    except (OSError, ValueError, RecursionError):  # unreadable, or not JSON (gzip, binary, ...)
        return False
    return isinstance(doc, dict) and "traceEvents" not in doc and bool(_CONFIG_KEYS & doc.keys())


def not_a_model_config(path: str | os.PathLike[str]) -> None:
    """Raise the one-line hint when a trace argument is a model config, or a folder without
    traces whose config.json is one (a Hugging Face model directory)."""
    p = Path(path)
    if is_model_config(p):
        raise InputError(f"{p}: this is a model config, not a trace: pass it as --model {p}")
    if p.is_dir() and is_model_config(p / "config.json"):
        raise InputError(f"{p}: holds no trace but a model config (config.json): pass it as "
                         f"--model {p}")


def out_dir(value: str | None) -> Path | None:
    """--out as a Path (None without it), refused before the work when it exists and is not a
    directory."""
    out = Path(value) if value else None
    if out is not None and out.exists() and not out.is_dir():
        raise InputError(f"{out}: --out exists and is not a directory")
    return out


def option_files(*values: str | None) -> list[str]:
    """The --model/--hardware values that are files (an HF config.json, a hardware JSON)."""
    return [v for v in values if v and Path(v).is_file()]


def outputs_of(args: argparse.Namespace, out: Path | None,
               names: Sequence[str]) -> list[tuple[str, Path]]:
    """(flag, path) of every output the command may write: --json, --perfetto, --out's files."""
    given = [(f"--{flag}", Path(getattr(args, flag))) for flag in ("json", "perfetto")
             if getattr(args, flag, None)]
    return given + ([("--out", out / name) for name in names] if out is not None else [])


def write_and_print(text: str, outputs: dict[Path, bytes], inputs: Sequence[str | None],
                    out: Path | None, names: Sequence[str]) -> int:
    """Write `outputs` (none over an input; `names` the set `out` may hold), then print `text`
    with the files written."""
    if outputs:
        written = write_files(outputs, inputs=inputs, sets={out: names} if out is not None
                              else None)
        text += "\n\nwrote " + ", ".join(str(p) for p in written)
    print(text)
    return 0

