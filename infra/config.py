"""The command line of every entry point: argparse, with a dataclass as the option list where a
script has one (train_twice.py, eval.py, lab/audit.py, lab/replay.py):

    python SCRIPT.py [PRESET.cfg ...] [--key=value | --key value | --flag ...]

`parser(cls)` builds the script's argparse parser from its dataclass: one `--field` option per
field, typed by the field's annotation. Preset files hold `key = value` lines (`#` starts a comment)
and are applied in order, then the command-line options. Each value is coerced to the field's type;
an unknown key is refused with the closest match and the list of valid ones; every value is
range-checked by the dataclass's `checks()` with a message naming the field. `--help` / `-h` prints
every field with its default and the comment written after it in the dataclass (the nanoGPT-style
source is the documentation; a comment may go on over lines that start with `#` and two spaces).
Scripts whose commands take a few options (retriever.py, lab/report.py, perf/ledger.py, ...) build
their argparse parser by hand; `check_flags` range-checks their numeric flags.
"""
import argparse
import dataclasses
import difflib
import inspect
import math
import os
import re
import sys

_COMMENT = re.compile(r"^\s+(\w+)\s*:[^=]+=.*?#\s?(.*)$")
_MORE = re.compile(r"^\s+#\s{2,}(\S.*)$")  # a field's comment, continued on the lines below it


def field_docs(cls) -> dict:
    """{field: the comment after its definition in the class source, with its continuation lines},
    base classes included (a script's Config may inherit the fields of another dataclass)."""
    docs = {}
    for klass in reversed(cls.__mro__):
        try:
            source = inspect.getsource(klass) if dataclasses.is_dataclass(klass) else ""
        # defined where no source is kept (an interactive session): no comments to show
        except OSError:
            source = ""
        field = None
        for line in source.splitlines():
            m, more = _COMMENT.match(line), _MORE.match(line)
            if m:
                field, docs[m.group(1)] = m.group(1), m.group(2).strip()
            elif more and field:
                docs[field] += " " + more.group(1).strip()
            else:
                field = None
    return docs


def usage(cls, prog: str, positional: str = "[PRESET.cfg ...]") -> str:
    """Every field with its type, default and comment, grouped as in the source."""
    docs = field_docs(cls)
    # a folder script: python -m
    command = prog if prog.endswith(".py") or " " in prog else f"-m {prog}"
    lines = [f"usage: python {' '.join(filter(None, [command, positional]))} [--key=value ...]", ""]
    # not dataclass's generated signature
    if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
        lines += [inspect.cleandoc(cls.__doc__), ""]
    for f in ordered_fields(cls):
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        lines.append(f"  --{f.name}={f.default!r}  ({kind})  {docs.get(f.name, '')}".rstrip())
    return "\n".join(lines)


def coerce(where: str, value: str, kind):
    """value (text) as the field's type; bools accept true/false/1/0/yes/no; quotes around a string
    are dropped."""
    kind = {"int": int, "float": float, "bool": bool, "str": str}.get(kind, kind)
    value = value.strip()
    if kind is bool:
        if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"{where}: expected a boolean (true/false), got {value!r}")
        return value.lower() in ("1", "true", "yes")
    if kind is str:
        text = value[1:-1] if len(
            value) >= 2 and value[0] == value[-1] and value[0] in "\"'" else value
        if text.startswith("--"):  # `--out_dir --steps=4`: the next flag taken as the value
            raise ValueError(
                f"{where}: the value {text!r} looks like a flag; give the value as --key=value")
        return text
    try:
        out = kind(value)
    except (ValueError, OverflowError):
        raise ValueError(f"{where}: expected {kind.__name__}, got {value!r}") from None
    # nan passes every range check and never equals itself on resume
    if kind is float and not math.isfinite(out):
        raise ValueError(f"{where}: expected a finite number, got {value!r}")
    return out


def ordered_fields(cls) -> list:
    """The dataclass's fields, its own first, then inherited ones."""
    own = cls.__dict__.get("__annotations__", {})
    return sorted(dataclasses.fields(cls), key=lambda f: f.name not in own)


def _types(cls) -> dict:
    return {f.name: f.type for f in ordered_fields(cls)}


def unknown_key(key: str, types: dict, where: str) -> ValueError:
    near = difflib.get_close_matches(key, list(types), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return ValueError(f"{where}: unknown config key {key!r}{hint}; valid keys: {', '.join(types)}")


def set_value(cfg, key: str, value: str, where: str):
    types = _types(type(cfg))
    if key not in types:
        raise unknown_key(key, types, where)
    setattr(cfg, key, coerce(f"{where}: {key}", value, types[key]))


def read_preset(cfg, path: str):
    """Apply a preset file of `key = value` lines; errors name the file and line."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such preset file (of `key = value` lines: configs/demo.cfg)")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise ValueError(f"{path}:{lineno}: expected `key = value`, got {line!r}")
            set_value(cfg, key.strip(), value, f"{path}:{lineno}")


def check(cfg):
    """Raise one ValueError naming every field whose value is out of range (cfg.checks(): (field,
    ok, rule))."""
    bad = [
        f"{name}={getattr(cfg, name)!r} (must be {rule})" for name, ok, rule in cfg.checks()
        if not ok
    ]
    if bad:
        raise ValueError(f"invalid config value(s): {'; '.join(bad)}")
    return cfg


class _Parser(argparse.ArgumentParser):
    """argparse, raising ValueError instead of exiting: parse() is a library call, cli() exits."""

    def error(self, message):
        raise ValueError(f"command line: {message}")


def parser(cls, prog: str = "", presets: bool = True) -> argparse.ArgumentParser:
    """The argparse parser of a dataclass: preset paths (positional), then one `--field` option per
    field. Values stay text here; parse() coerces them (errors name the field) and checks ranges."""
    p = _Parser(prog=prog or None, allow_abbrev=False, add_help=False)
    if presets:
        p.add_argument("presets", nargs="*")
    types = _types(cls)
    for name, kind in types.items():
        flag = kind in (bool, "bool")  # a bare --flag means true
        p.add_argument(f"--{name}", dest=name, default=argparse.SUPPRESS,
                       nargs="?" if flag else None, const="true" if flag else None)
    p.add_argument("-h", "--help", action="store_true", dest="_help")
    return p


def _flag_as_value(argv: list, types: dict):
    """`--out_dir --steps=4`: argparse would only say that --out_dir lacks a value."""
    for arg, nxt in zip(argv, argv[1:]):
        key = arg[2:] if arg.startswith("--") and "=" not in arg else ""
        if key in types and types[key] not in (bool, "bool") and nxt.startswith("--"):
            raise ValueError(
                f"command line: {key}: the value {nxt!r} looks like a flag; give the value as "
                f"--{key}=VALUE")


def parse(cls, argv, prog: str = "", presets: bool = True):
    """cls from presets (positional paths, in order) then the options; `--help` prints usage and
    exits 0. Fields are then range-checked, after cfg.resolve() (when defined) has filled derived
    blanks."""
    argv, types = list(argv), _types(cls)
    _flag_as_value(argv, types)
    args, rest = parser(cls, prog, presets).parse_known_args(argv)
    if args._help:
        print(usage(cls, prog or sys.argv[0], "[PRESET.cfg ...]" if presets else ""))
        raise SystemExit(0)
    for arg in rest:
        if arg.startswith("--"):
            raise unknown_key(arg[2:].partition("=")[0], types, "command line")
        raise ValueError(f"{arg}: unexpected argument; options are written --key=value")
    cfg = cls()
    for path in getattr(args, "presets", []):
        read_preset(cfg, path)
    for key in types:
        if hasattr(args, key):
            set_value(cfg, key, getattr(args, key), "command line")
    if hasattr(cfg, "resolve"):
        cfg.resolve()
    return check(cfg)


def cli(cls, argv=None, prog: str = "", presets: bool = True):
    """parse() for a script's __main__: a bad value exits with status 2 and the message, not a
    traceback."""
    try:
        return parse(cls, sys.argv[1:] if argv is None else argv, prog, presets)
    except BrokenPipeError:  # `--help | head`: the reader has all it wanted
        raise SystemExit(0) from None
    except (ValueError, OSError) as e:
        print(f"{prog or sys.argv[0]}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, ranges: dict):
    """Refuse (exit status 2, naming the flag) any numeric flag of a hand-built parser outside its
    range, before anything is loaded. ranges: flag name -> (lowest, highest or None, what else to
    say)."""
    for name, (low, high, hint) in ranges.items():
        value = getattr(args, name, None)
        if value is not None and not (low <= value and (high is None or value <= high)):
            within = f"in [{low}, {high}]" if high is not None else f">= {low}"
            parser.error(f"--{name} must be an integer {within}, got {value}{hint}")


def micro_batches(cfg) -> int:
    """The trainer's micro-batches per mini-batch on each rank, or a ValueError when the batch does
    not split."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.prompts_per_step % world:
        raise ValueError(f"prompts_per_step={cfg.prompts_per_step} must divide over {world} "
                         "processes")
    per_rank = cfg.prompts_per_step // world * cfg.group_size
    if per_rank % cfg.mini_batches:
        raise ValueError(f"{per_rank} episodes per rank do not split into "
                         f"mini_batches={cfg.mini_batches}")
    return math.ceil(per_rank // cfg.mini_batches / cfg.micro_batch_size)
