"""The built-in worlds' digests (DESIGN.md section 9): `worlds.lock` holds a content sha256 of every
file of each committed world (preset x seed x scale), built on pinned numerics (infra/numerics.py),
so that a build on any machine can be checked against the one the repository's figures were measured
on.

A digest is of the file's bytes, except for files that also hold what is not the world:
index/meta.json's absolute paths (of the corpus and of the encoder's installed folder), world.json's
build timings and the policy's config files' `transformers_version` (the library that wrote them,
not the world: the same world is written by any version). Those fields are left out, and the rest
of the JSON is digested in a canonical form (sorted keys, no spaces).

Lock lines: `<preset> <seed> <scale> <file> <sha256>`; `#` starts a comment. This module knows files
and digests; what a world is and how it is built is worlds/build.py's.
"""
import hashlib
import json
import os

LOCK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worlds.lock")
NON_CONTENT = {
    "index/meta.json": (("corpus", ), ("encoder_resolved", )), "world.json": (("stats", "times"), ),
    "policy/config.json": (("transformers_version", ), ),
    "policy/generation_config.json": (("transformers_version", ), ),
}
HEADER = """\
# Content digests of the built-in worlds (DESIGN.md section 9), one line per file: preset seed scale file sha256.
# Built on pinned numerics (infra/numerics.py) by `python -m worlds.build --out DIR --preset P --seed S --scale C`; `python -m worlds.build
# --verify DIR` compares a built world with its entry; `python -m worlds.build --lock DIR` writes its entry (a new world).
"""


def content_bytes(folder: str, rel: str) -> bytes:
    """The bytes of `rel` that are the world: the whole file, or the JSON less its NON_CONTENT
    fields."""
    with open(os.path.join(folder, rel), "rb") as f:
        data = f.read()
    if rel not in NON_CONTENT:
        return data
    obj = json.loads(data)
    for path in NON_CONTENT[rel]:
        parent = obj
        for key in path[:-1]:
            parent = parent.get(key, {})
        parent.pop(path[-1], None)
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def world_digests(folder: str) -> dict:
    """{relative path: sha256 of its content} of every file under `folder`."""
    rels = sorted(os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/")
                  for d, _, files in os.walk(folder) for f in files)
    return {rel: hashlib.sha256(content_bytes(folder, rel)).hexdigest() for rel in rels}


def world_key(folder: str) -> tuple:
    """(preset, seed, scale) of a built world, from its world.json."""
    path = os.path.join(folder, "world.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} not found: {folder} is not a built world (build it: `make world "
            f"WORLD={folder} PRESET=tiny|chains`; worlds/build.py writes world.json last)")
    with open(path, encoding="utf-8") as f:
        stats = json.load(f)["stats"]
    return stats.get("preset", "tiny"), int(stats["seed"]), stats["scale"]


def read_lock(path: str = LOCK) -> dict:
    """{(preset, seed, scale): {file: sha256}}; ValueError naming the file and line of a bad line.
    """
    entries = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) != 5 or not words[1].isdigit() or len(words[4]) != 64:
                raise ValueError(
                    f"{path}, line {n}: expected 'preset seed scale file sha256', got {line.strip()!r}"
                )
            files = entries.setdefault((words[0], int(words[1]), words[2]), {})
            if words[3] in files:
                raise ValueError(
                    f"{path}, line {n}: {words[3]} of {' '.join(words[:3])} is listed twice")
            files[words[3]] = words[4]
    return entries


def write_entry(folder: str, path: str = LOCK) -> tuple:
    """Replace (or add) the entry of the world in `folder` in the lock file; returns its key."""
    entries = read_lock(path) if os.path.exists(path) else {}
    key = world_key(folder)
    entries[key] = world_digests(folder)
    lines = [f"{p} {s} {c} {rel} {digest}\n" for (p, s, c), files in sorted(entries.items())
             for rel, digest in files.items()]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(HEADER + "".join(lines))
    os.replace(tmp, path)
    return key


def compare(folder: str, path: str = LOCK):
    """(key, differing files) of the world in `folder` against its lock entry: files whose digest
    differs, is missing from the world or is not in the entry; None in place of the list when the
    lock has no entry for it."""
    key = world_key(folder)
    locked = read_lock(path).get(key) if os.path.exists(path) else None
    if locked is None:
        return key, None
    built = world_digests(folder)
    return key, sorted(rel for rel in set(locked) | set(built) if locked.get(rel) != built.get(rel))


def verdict(folder: str, path: str = LOCK):
    """(ok, message) for a built world: same as its lock entry, different (which files, and what
    that means), or not in the lock."""
    key, differing = compare(folder, path)
    name = f"{folder} ({key[0]}, seed {key[1]}, {key[2]} scale)"
    if differing is None:
        return True, f"{name}: no entry in {os.path.basename(path)}, nothing to compare"
    if not differing:
        return True, f"{name}: every file matches {os.path.basename(path)}"
    with open(os.path.join(folder, "world.json"), encoding="utf-8") as f:
        numerics = json.load(f)["stats"].get("numerics", {})
    how = ("built on pinned numerics" if numerics.get("pinned") else
           f"built on this machine's own numerics ({json.dumps(numerics)})"
           if numerics else "built before the pins")
    return False, (
        f"{name}: {len(differing)} file(s) differ from {os.path.basename(path)}: {', '.join(differing)}.\n"
        f"This is a different world from the committed one ({how}): every figure measured on it (its "
        "warm-start statistics, training curves, audits) will differ from RESULTS.md.")
