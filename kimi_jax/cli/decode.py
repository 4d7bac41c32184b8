"""`python -m kimi_jax.decode`: generate from a prompt with AR, DFlash or DDTree decoding.

With no arguments it loads the embedded default (checkpoints/target + checkpoints/drafter) and continues a
built-in prompt with DDTree. Text streams as rounds are accepted (``--stream``), then one stats line follows.
Every error is one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from kimi_jax import fields
from kimi_jax.cli import cluster
from kimi_jax.cli.exits import exit_with, run_command

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_TARGET = ROOT / "checkpoints" / "target"
DEFAULT_DRAFTER = ROOT / "checkpoints" / "drafter"
DEFAULT_PROMPT = ('class Queue:\n    """A first-in, first-out queue."""\n\n    def __init__(self):\n        self.items = []\n\n'
                  '    def put(self, item):\n')


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):                      # one line, not usage + message
        print(f"{self.prog.removeprefix('python -m ')}: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_budget(p: argparse.ArgumentParser, budget: str):
    """--budget: 'auto' or a number of tree nodes."""
    if budget == "auto":
        return budget
    try:
        return int(budget)
    except ValueError:
        p.error(f"--budget must be 'auto' or an integer >= 0, got {budget!r}")


def _parse(argv):
    p = OneLineParser(prog="python -m kimi_jax.decode", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (default: a built-in code prompt)")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    p.add_argument("--checkpoint", default=str(DEFAULT_TARGET), help="target checkpoint directory")
    p.add_argument("--drafter", default=None, help="drafter directory ('none' for AR only)")
    p.add_argument("--method", choices=("ar", "dflash", "ddtree"), default=None)
    p.add_argument("--budget", default="auto",
                   help="DDTree node budget: 'auto' (default: the width that maximises expected tokens per second "
                        "under costs calibrated on this machine, chosen every round) or a number of nodes")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("logits processors (kimi_jax.decoding.processors; ranges in kimi_jax.fields)")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=None, help="keep the smallest set of tokens of this mass")
    g.add_argument("--min-p", type=float, default=None, help="drop tokens below this fraction of the top one")
    g.add_argument("--presence-penalty", type=float, default=None, help="OpenAI's: minus this for any repeat")
    g.add_argument("--frequency-penalty", type=float, default=None, help="OpenAI's: minus this per repeat")
    g.add_argument("--repetition-penalty", type=float, default=None, help="HF's: divide repeats' logits by this")
    g.add_argument("--logit-bias", default=None, metavar="JSON",
                   help='a JSON map of token id to bias in [-100, 100], e.g. \'{"42": -100}\'')
    g = p.add_argument_group("structured output (kimi_jax.text.grammar); one of")
    so = g.add_mutually_exclusive_group()
    so.add_argument("--json-schema", metavar="FILE", help="the reply is JSON valid against this JSON Schema file")
    so.add_argument("--json-object", action="store_true", help="the reply is a JSON object")
    so.add_argument("--regex", help="the reply matches this regular expression")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--mesh", default=None, help="device mesh, e.g. tp=8 (across processes: over all of their devices)")
    p.add_argument("--stream", action="store_true", help="print text as each chunk of rounds is accepted")
    p.add_argument("--json", action="store_true", help="print one JSON object (tokens, text, stats)")
    p.add_argument("--verify", action="store_true",
                   help="checksum every weight file against the checkpoint's manifest (sizes are always checked)")
    cluster.add_arguments(p)
    args = p.parse_args(argv)
    cluster.check_arguments(p, args)
    args.budget = parse_budget(p, args.budget)
    args.processing = _processing(p, args)
    # the API's own checks, before anything is loaded
    fields.check(max_new_tokens=args.max_new_tokens, method=args.method, budget=args.budget,
                 temperature=args.temperature, seed=args.seed, **{k: v for k, v in args.processing.items()
                                                                  if k in fields.PROCESSORS})
    return args


def _processing(p: argparse.ArgumentParser, args) -> dict:
    """The logits processors and structured output the flags ask for, as Model.generate takes them."""
    values = {name: getattr(args, name) for name in fields.PROCESSORS if name != "logit_bias"
              and getattr(args, name) is not None}
    if args.logit_bias is not None:
        try:
            values["logit_bias"] = json.loads(args.logit_bias)
        except json.JSONDecodeError as e:
            p.error(f"--logit-bias must be a JSON object of token id to bias: {e}")
    if args.json_schema is not None:
        try:
            with open(args.json_schema, encoding="utf-8") as f:
                schema = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            p.error(f"--json-schema: cannot read a JSON schema from {args.json_schema}: {e}")
        values["response_format"] = {"type": "json_schema", "json_schema": {"name": "cli", "schema": schema}}
    elif args.json_object:
        values["response_format"] = {"type": "json_object"}
    elif args.regex is not None:
        values["regex"] = args.regex
    return values


def _stats_line(stats) -> str:
    """One line from Generation.stats; the optional keys (the drafter's state, a compile time) only when present."""
    parts = [f"{stats['new_tokens']} new tokens", f"{stats['tokens_per_s']:.1f} tok/s",
             f"mean tau {stats['mean_tau']:.2f}", f"{stats['rounds']} rounds"]
    widths = stats.get("width_per_round") or []
    if widths:
        parts.append("widths " + " ".join(f"{w}x{widths.count(w)}" for w in sorted(set(widths))))
    if stats.get("drafter"):
        parts.append(f"drafter {stats['drafter']}")
    parts.append(f"{stats['dispatches']} dispatches")
    if stats.get("compile_s"):          # 0 or absent: nothing was compiled for this call, or it was not timed
        parts.append(f"compiled in {stats['compile_s']:.1f} s")
    return f"[{', '.join(parts)}]"


def persistent_compile_cache():
    """Keep compiled programs across runs (the auto policy's program takes ~20 s to compile on a CPU), under
    $KIMI_JAX_CACHE/xla unless the user configured JAX's own cache."""
    import jax
    if not jax.config.jax_compilation_cache_dir:
        from kimi_jax.decoding.costs import cache_root
        jax.config.update("jax_compilation_cache_dir", os.path.join(cache_root(), "xla"))


def drafter_dir(args) -> str | None:
    """--drafter: the embedded default's drafter beside the embedded target, 'none' or --method ar for none."""
    if args.drafter == "none" or args.method == "ar":
        return None
    if args.drafter is None and args.checkpoint == str(DEFAULT_TARGET):
        return str(DEFAULT_DRAFTER)
    return args.drafter


def read_prompt(args) -> str:
    """--prompt, --prompt-file's text, or the built-in prompt. A file that cannot be used is one line naming it and
    what is wrong, before JAX or the model loads."""
    if not args.prompt_file:
        return DEFAULT_PROMPT if args.prompt is None else args.prompt
    name = args.prompt_file
    try:
        data = pathlib.Path(name).read_bytes()
    except FileNotFoundError:
        raise fields.GenerationError(f"prompt file {name!r} does not exist") from None
    except IsADirectoryError:
        raise fields.GenerationError(f"prompt file {name!r} is a directory") from None
    except OSError as e:
        raise fields.GenerationError(f"prompt file {name!r} cannot be read: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fields.GenerationError(f"prompt file {name!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at "
                                     f"offset {e.start})") from None


def run(argv=None) -> int:
    args = _parse(argv)
    if args.coordinator is not None:    # first: a process that fails after joining ends the others
        cluster.join(args, "kimi_jax.decode")
    prompt = read_prompt(args)          # before JAX loads, unless joining loaded it
    cluster.join(args, "kimi_jax.decode")
    persistent_compile_cache()
    import kimi_jax

    drafter = drafter_dir(args)
    model = kimi_jax.load(args.checkpoint, drafter=drafter, mesh=args.mesh, verify=args.verify or None)
    if model.tokenizer is None:
        raise fields.GenerationError(f"{args.checkpoint} has no tokenizer; use the Python API with ids")
    method = args.method or ("ddtree" if model.drafter is not None else "ar")
    kw = dict(max_new_tokens=args.max_new_tokens, method=method, budget=args.budget,
              temperature=args.temperature, seed=args.seed, **args.processing)
    with cluster.quiet_unless_leader():     # every process runs the program; process 0 prints
        result = _generate(model, prompt, method, kw, args)
    if result is not None and cluster.leader():
        print(_stats_line(result.stats), file=sys.stderr)
    return 0


def _generate(model, prompt, method, kw, args):
    """Generate and print the text (or the JSON object); -> the Generation whose stats line follows, or None."""
    from kimi_jax.text.tokenizer import StreamDecoder

    if args.stream and not args.json:
        sys.stdout.write(prompt)
        decoder = StreamDecoder(model.tokenizer)
        for item in model.stream(prompt, **kw):
            if isinstance(item, list):
                sys.stdout.write(decoder.push(item[0]))
                sys.stdout.flush()
            else:
                result = item
        sys.stdout.write(decoder.flush() + "\n")
    else:
        result = model.generate(prompt, **kw)
        if args.json:
            print(json.dumps({"prompt": prompt, "tokens": result.tokens[0], "text": result.text[0],
                              "method": method, "stats": {k: v for k, v in result.stats.items()}}))
            return None
        print(prompt + result.text[0])
    return result


def main(argv=None) -> int:
    return run_command("kimi_jax.decode", lambda: run(argv))


if __name__ == "__main__":
    exit_with(main())
