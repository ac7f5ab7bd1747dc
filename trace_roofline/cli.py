"""`trace-roofline` command line: a thin layer that parses arguments, calls the library, prints/writes.

Every user error ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from trace_roofline import calculator, costs
from trace_roofline.errors import InputError
from trace_roofline.hardware import get_hardware
from trace_roofline.models import get_model

PROG = "trace-roofline"


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line (no usage dump) with exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_convention_args(p: argparse.ArgumentParser, lesson: bool = False) -> None:
    """--causal / --attention-bytes (and --lesson where the lesson's table is reproducible)."""
    p.add_argument("--causal", choices=costs.CAUSAL_CONVENTIONS, default="causal",
                   help="attention FLOPs: every query-key pair (full) or unmasked ones (causal)")
    p.add_argument("--attention-bytes", choices=costs.ATTENTION_BYTES_CONVENTIONS, default="all",
                   help="attention bytes: K,V reads only (kv) or Q,K,V read + O written (all)")
    if lesson:
        p.add_argument("--lesson", action="store_true",
                       help="the lesson's conventions: --causal full --attention-bytes kv")


def _cmd_intensity(args: argparse.Namespace) -> int:
    if args.lesson:
        args.causal, args.attention_bytes = "full", "kv"
    table = calculator.intensity_table(
        get_model(args.model), get_hardware(args.hardware), args.m, args.s,
        args.causal, args.attention_bytes, args.fused,
    )
    print(json.dumps(table, indent=2) if args.json else calculator.format_intensity(table))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("intensity", help="shape-only GEMM/attention intensity, regimes, M* and S*")
    p.add_argument("--model", default="qwen2.5-7b", help="preset name or HF config.json")
    p.add_argument("--hardware", default="rtx4090", help="preset name or hardware JSON file")
    p.add_argument("--m", type=_int_list, default=[1, 256], help="tokens in flight, e.g. 1,256")
    p.add_argument("--s", type=_int_list, default=[128, 512, 2048], help="context lengths")
    p.add_argument("--fused", action="store_true", help="fused qkv_proj / gate_up_proj layout")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    add_convention_args(p, lesson=True)
    p.set_defaults(func=_cmd_intensity)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
