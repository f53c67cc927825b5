"""One config mechanism for every script (train_twice.py, lab/audit.py, eval.py): a dataclass per script, read as

    python SCRIPT.py [PRESET.cfg ...] [--key=value | --key value | --flag ...]

Preset files hold `key = value` lines (`#` starts a comment) and are applied in order, then the command-line
overrides. Each value is coerced to the field's annotated type; an unknown key is refused with the list of valid
ones; every value is range-checked by the dataclass's `checks()` with a message naming the field. `--help` / `-h`
prints every field with its default and the comment written after it in the dataclass (the nanoGPT-style source is
the documentation). Why a file of its own: three scripts share it, and none of them owns the others' configs.
"""
import dataclasses
import inspect
import math
import re
import sys

_COMMENT = re.compile(r"^\s+(\w+)\s*:[^=]+=.*?#\s?(.*)$")


def field_docs(cls) -> dict:
    """{field: the comment after its definition in the class source}, base classes included (a script's Config
    may inherit the fields of another dataclass)."""
    docs = {}
    for klass in reversed(cls.__mro__):
        try:
            source = inspect.getsource(klass) if dataclasses.is_dataclass(klass) else ""
        except OSError:  # defined where no source is kept (an interactive session): no comments to show
            source = ""
        for line in source.splitlines():
            m = _COMMENT.match(line)
            if m:
                docs[m.group(1)] = m.group(2).strip()
    return docs


def usage(cls, prog: str, positional: str = "[PRESET.cfg ...]") -> str:
    """Every field with its type, default and comment, grouped as in the source."""
    docs = field_docs(cls)
    lines = [f"usage: python {prog} {positional} [--key=value ...]", ""]
    if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):  # not dataclass's generated signature
        lines += [inspect.cleandoc(cls.__doc__), ""]
    for f in ordered_fields(cls):
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        lines.append(f"  --{f.name}={f.default!r}  ({kind})  {docs.get(f.name, '')}".rstrip())
    return "\n".join(lines)


def coerce(where: str, value: str, kind):
    """value (text) as the field's type; bools accept true/false/1/0/yes/no; quotes around a string are dropped."""
    kind = {"int": int, "float": float, "bool": bool, "str": str}.get(kind, kind)
    value = value.strip()
    if kind is bool:
        if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"{where}: expected a boolean (true/false), got {value!r}")
        return value.lower() in ("1", "true", "yes")
    if kind is str:
        text = value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'" else value
        if text.startswith("--"):  # `--out_dir --steps=4`: the next flag taken as the value
            raise ValueError(f"{where}: the value {text!r} looks like a flag; give the value as --key=value")
        return text
    try:
        out = kind(value)
    except (ValueError, OverflowError):
        raise ValueError(f"{where}: expected {kind.__name__}, got {value!r}") from None
    if kind is float and not math.isfinite(out):  # nan passes every range check and never equals itself on resume
        raise ValueError(f"{where}: expected a finite number, got {value!r}")
    return out


def ordered_fields(cls) -> list:
    """The dataclass's fields, its own first, then inherited ones."""
    own = cls.__dict__.get("__annotations__", {})
    return sorted(dataclasses.fields(cls), key=lambda f: f.name not in own)


def _types(cls) -> dict:
    return {f.name: f.type for f in ordered_fields(cls)}


def set_value(cfg, key: str, value: str, where: str):
    types = _types(type(cfg))
    if key not in types:
        raise ValueError(f"{where}: unknown config key {key!r}; valid keys: {', '.join(types)}")
    setattr(cfg, key, coerce(f"{where}: {key}", value, types[key]))


def read_preset(cfg, path: str):
    """Apply a preset file of `key = value` lines; errors name the file and line."""
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
    """Raise one ValueError naming every field whose value is out of range (cfg.checks(): (field, ok, rule))."""
    bad = [f"{name}={getattr(cfg, name)!r} (must be {rule})" for name, ok, rule in cfg.checks() if not ok]
    if bad:
        raise ValueError(f"invalid config value(s): {'; '.join(bad)}")
    return cfg


def parse(cls, argv, prog: str = "", presets: bool = True):
    """cls from presets (positional paths) then overrides; `--help` prints usage and exits 0. Fields are then
    range-checked, after cfg.resolve() (when defined) has filled derived blanks."""
    argv = list(argv)
    if "-h" in argv or "--help" in argv:
        print(usage(cls, prog or sys.argv[0]))
        raise SystemExit(0)
    cfg, types, i = cls(), _types(cls), 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            if not presets:
                raise ValueError(f"{arg}: unexpected argument; options are written --key=value")
            read_preset(cfg, arg)
            continue
        key, sep, value = arg[2:].partition("=")
        if not sep:  # `--key value`, or a bare `--flag` for a boolean
            if types.get(key) in (bool, "bool") and (i == len(argv) or argv[i].startswith("--")):
                value = "true"
            elif i < len(argv):
                value, i = argv[i], i + 1
            else:
                raise ValueError(f"{arg}: missing value; write --{key}=VALUE")
        set_value(cfg, key, value, "command line")
    if hasattr(cfg, "resolve"):
        cfg.resolve()
    return check(cfg)


def cli(cls, argv=None, prog: str = "", presets: bool = True):
    """parse() for a script's __main__: a bad value exits with status 2 and the message, not a traceback."""
    try:
        return parse(cls, sys.argv[1:] if argv is None else argv, prog, presets)
    except (ValueError, OSError) as e:
        print(f"{prog or sys.argv[0]}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
