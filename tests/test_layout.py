"""The layout reads one way (DESIGN.md section 2): two floors, every import pointing down the order below
(imports inside functions included), no cycle, every entry point answers --help, sizes and lines within
bounds, and every reference in code and docs resolves."""
import ast
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_POINTS = ("train_twice", "rollout", "retriever", "eval")  # what a user runs from the top level
FOLDERS = ("generation", "methods", "retrieval", "worlds", "lab", "perf", "infra")
MAX_TOP_LEVEL_OTHERS = 8  # the method's own modules beside the entry points
# Bottom to top: a module imports only modules before it. The consumers at the end (the server, the worlds'
# builder, the lab, the instruments) import the method; nothing in the method imports them.
ORDER = [
    "infra", "generation", "retrieval", "worlds", "lab", "perf",  # folder docstrings: they import nothing
    "infra.config", "infra.cuda", "infra.watchdog", "infra.phases", "infra.numerics", "infra.adamw", "infra.weights",
    "protocol",
    "sampler",
    "generation.stops", "generation.rows", "generation.kvcache", "generation.engine", "generation.kvbudget",
    "generation.logprobs",
    "credit", "retrieval.index", "retrieval.dense", "retrieval.bm25", "retrieval.search", "retriever",
    "rollout", "forks", "twice", "eval", "infra.lora", "generation.vllm_engine", "infra.checkpoint", "infra.console",
    "methods.baselines", "methods.learned", "methods.oracle", "methods", "train_twice",
    "retrieval.limits", "retrieval.server",
    "worlds.lock", "worlds.base", "worlds.tiny", "worlds.chains", "worlds.build", "worlds.data",
    "lab.report", "lab.audit_scores", "lab.audit_methods", "lab.audit", "lab.twinview", "lab.replay", "lab.benchmark", "lab.suite",
    "lab.headroom", "lab.frontier", "lab.gradaudit",
    "perf.memtrack", "perf.memprobe", "perf.ledger", "perf.bench_engine", "perf.bench_vllm", "perf.bench_server",
    "perf.bench", "perf.budget",
    "perf.gpucheck", "perf.nodecheck", "perf.smoke", "perf.probe", "perf.cpucheck",
]
LONG_LINE, LONG_LINE_SHARE = 100, 0.10  # characters; share of code lines allowed past it
MAX_MODULE_LINES = 700


def module_files() -> dict:
    """{dotted name: path} of every project module: the top level and the folders (a package's __init__.py is
    the folder's own name)."""
    out = {os.path.splitext(os.path.basename(p))[0]: p for p in glob.glob(os.path.join(ROOT, "*.py"))}
    for folder in FOLDERS:
        for p in glob.glob(os.path.join(ROOT, folder, "*.py")):
            stem = os.path.splitext(os.path.basename(p))[0]
            out[folder if stem == "__init__" else f"{folder}.{stem}"] = p
    return out


MODULES = module_files()


def imports_of(module: str) -> set:
    """Every project module that `module` imports, anywhere in the file: `import a.b`, `from a import b` (b a
    module of folder a, or a name of module a) and `from a.b import c`."""
    tree = ast.parse(open(MODULES[module], encoding="utf-8").read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                      for a in node.names}
    return {name for name in found if name in MODULES} - {module}


def test_two_floors_the_entry_points_and_the_method_on_top():
    top = sorted(m for m in MODULES if "." not in m and m not in FOLDERS)
    others = sorted(set(top) - set(ENTRY_POINTS))
    assert set(ENTRY_POINTS) <= set(top) and len(others) <= MAX_TOP_LEVEL_OTHERS, others
    for folder in FOLDERS:
        init = os.path.join(ROOT, folder, "__init__.py")
        assert os.path.isfile(init) and ast.get_docstring(ast.parse(open(init).read())), \
            f"{folder}/__init__.py must say what the folder holds"
    stray = [p for p in glob.glob(os.path.join(ROOT, "*", "*.py"))
             if os.path.basename(os.path.dirname(p)) not in FOLDERS + ("tests",)]
    assert not stray, stray


def test_no_import_cycle():
    graph = {m: imports_of(m) for m in MODULES}
    state = {}

    def visit(m, path):
        if state.get(m) == "open":
            raise AssertionError(f"import cycle: {' -> '.join(path + [m])}")
        if state.get(m) != "done":
            state[m] = "open"
            for dep in sorted(graph[m]):
                visit(dep, path + [m])
            state[m] = "done"
    for m in MODULES:
        visit(m, [])


def test_every_arrow_points_down():
    """Each module imports only those before it in ORDER, and ORDER names every module once."""
    assert sorted(ORDER) == sorted(MODULES) and len(set(ORDER)) == len(ORDER), \
        sorted(set(ORDER) ^ set(MODULES))
    up = [f"{m} imports {sorted(imports_of(m) & set(ORDER[i + 1:]))}" for i, m in enumerate(ORDER)
          if imports_of(m) & set(ORDER[i + 1:])]
    assert not up, "\n".join(up)


def test_no_folder_imports_back_the_entry_point_that_imports_it():
    """An entry point's folders (those it imports a module of) never import it: retrieval/ lies below retriever.py,
    so its server searches through retrieval/search.py, not retriever.py (DESIGN.md section 2). Consumers such as
    lab/ and perf/ import the entry points, which never import them."""
    back = []
    for entry in ENTRY_POINTS:
        below = {m.split(".")[0] for m in imports_of(entry)} & set(FOLDERS)
        back += [f"{m} imports {entry}" for m in MODULES if m.split(".")[0] in below and entry in imports_of(m)]
    assert {"retrieval", "generation", "methods", "infra"} <= {m.split(".")[0] for e in ENTRY_POINTS
                                                              for m in imports_of(e)}  # the rule has folders to check
    assert not back, "\n".join(back)


def interface() -> set:
    """The names of train_twice.py that its docstring declares as the lab's interface."""
    doc = ast.get_docstring(ast.parse(open(MODULES["train_twice"], encoding="utf-8").read()))
    part = doc[doc.index("as an interface"):]
    return set(re.findall(r"`(\w+)`", part))


def test_the_lab_uses_only_the_trainers_declared_interface():
    import train_twice as tt
    declared = interface()
    assert declared and all(hasattr(tt, name) for name in declared), declared - set(dir(tt))
    used = set()
    for module, path in MODULES.items():
        if module.split(".")[0] in ("lab", "perf", "methods", "worlds", "retrieval"):
            used |= set(re.findall(r"\b(?:tt|train_twice)\.([A-Za-z_]\w*)\b", open(path).read()))
    used -= {"py"}  # train_twice.py, the file
    assert used <= declared, f"not declared in train_twice's docstring: {sorted(used - declared)}"


def entry_points() -> list:
    """(command, module) of every script: the top-level entry points, and every folder module with a main guard
    (run as python -m folder.name)."""
    out = [([f"{m}.py"], m) for m in ENTRY_POINTS]
    for module, path in sorted(MODULES.items()):
        if "." in module and 'if __name__ == "__main__":' in open(path).read():
            out.append((["-m", module], module))
    return out


HELP_FLAGS = ("--help", "-h")


def answer_helps(jobs: list, out: str):
    """Run in a child process: each (command, flag) of `jobs` as `python COMMAND FLAG` runs it, in a process forked
    from this one; its exit status and output go to out/<i>.json. The libraries that most entry points load are
    imported once, before the forks (~6 s of CPU each time otherwise); every project module is imported afresh in
    each fork."""
    import json
    import runpy
    import traceback
    import faiss, numpy, torch  # noqa: E401, F401
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    for i, (command, flag) in enumerate(jobs):
        files = [os.path.join(out, f"{i}.{name}") for name in ("out", "err")]
        pid = os.fork()
        if pid == 0:
            for fd, path in zip((1, 2), files):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.path.insert(0, ROOT)  # as `python X.py` and `python -m X` in ROOT
            sys.argv = [command[-1] if command[0] == "-m" else os.path.join(ROOT, command[0]), flag]
            code = 0
            try:
                if command[0] == "-m":
                    runpy.run_module(command[1], run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(sys.argv[0], run_name="__main__")
            except SystemExit as e:
                code = e.code
            except BaseException:
                traceback.print_exc()
                code = 1
            if code is not None and not isinstance(code, int):  # as the interpreter: the message, status 1
                print(code, file=sys.stderr)
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code or 0)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        with open(os.path.join(out, f"{i}.json"), "w") as f:
            json.dump({"status": status, "out": open(files[0]).read(), "err": open(files[1]).read()}, f)


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict:
    """{(module, flag): (exit status, stdout, stderr)} of every entry point and help flag, all from one child process
    (answer_helps): a fresh interpreter per command cost ~150 s of CPU in all, nearly all of it importing torch and
    transformers again."""
    import json
    out = str(tmp_path_factory.mktemp("helps"))
    jobs = [(command, flag) for command, _ in entry_points() for flag in HELP_FLAGS]
    keys = [(module, flag) for _, module in entry_points() for flag in HELP_FLAGS]
    code = (f"import sys; sys.path[:0] = [{os.path.dirname(__file__)!r}, {ROOT!r}]; import test_layout; "
            f"test_layout.answer_helps({jobs!r}, {out!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.load(open(os.path.join(out, f"{i}.json"))) for i in range(len(jobs))]
    return {key: (r["status"], r["out"], r["err"]) for key, r in zip(keys, results)}


@pytest.mark.parametrize("command,module", entry_points(), ids=[m for _, m in entry_points()])
def test_every_entry_point_answers_help(helps, command, module):
    for flag in HELP_FLAGS:
        status, out, err = helps[module, flag]
        assert status == 0, err[-2000:]
        assert "usage" in out.lower()


def test_train_help_lists_every_field_with_default_and_comment(helps):
    import train_twice as tt
    text = helps["train_twice", "--help"][1]
    for f in tt.Config.__dataclass_fields__.values():
        line = next(x for x in text.splitlines() if x.strip().startswith(f"--{f.name}="))
        assert repr(f.default) in line and len(line.split(")  ", 1)[-1]) > 3, line  # default and its comment


def test_bad_value_exits_with_a_message_not_a_traceback():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_twice.py"), "--micro_batch_size=0"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "micro_batch_size=0 (must be >= 1)" in proc.stderr
    assert "Traceback" not in proc.stderr


# --- the repository reads as one: sizes, lines, prose in three places, every reference resolves ---
DOCS = ["README.md", "DESIGN.md", "RESULTS.md", "LOG.md"]
TESTS = sorted(glob.glob(os.path.join(ROOT, "tests", "*.py")))
TEXT_FILES = (sorted(MODULES.values()) + TESTS + sorted(glob.glob(os.path.join(ROOT, "configs", "*"))) +
              [os.path.join(ROOT, "Makefile")] + [os.path.join(ROOT, d) for d in DOCS])


def read(path: str) -> str:
    return open(path, encoding="utf-8").read()


def test_module_sizes():
    for module, path in MODULES.items():
        n = len(read(path).splitlines())
        assert n <= MAX_MODULE_LINES, f"{os.path.relpath(path, ROOT)} has {n} lines (> {MAX_MODULE_LINES})"
    assert len(read(MODULES["train_twice"]).splitlines()) <= 500
    assert len(read(MODULES["rollout"]).splitlines()) <= 600


def test_few_lines_pass_100_characters():
    code = [line for path in MODULES.values() for line in read(path).splitlines() if line.strip()]
    long = [line for line in code if len(line) > LONG_LINE]
    assert len(long) < LONG_LINE_SHARE * len(code), f"{len(long)} of {len(code)} code lines over {LONG_LINE}"


def test_prose_lives_in_three_places_and_the_readme_is_a_front_page():
    for doc in DOCS:
        assert os.path.isfile(os.path.join(ROOT, doc)), doc
    assert len(read(os.path.join(ROOT, "README.md")).splitlines()) <= 250


def test_no_tracker_numbers():
    for path in TEXT_FILES:
        for n, line in enumerate(read(path).splitlines(), 1):
            assert not re.search(r"\b[Ii]ssues? #?\d+\b", line), f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}"


def headings(doc: str) -> list:
    return [h.strip() for h in re.findall(r"^#+ (.*)$", read(os.path.join(ROOT, doc)), re.M)]


def module_path(dotted: str) -> str:
    base = os.path.join(ROOT, *dotted.split("."))
    return base + ".py" if os.path.isfile(base + ".py") else os.path.join(base, "__init__.py")


def test_every_reference_resolves():
    """Cited documents exist; `DESIGN.md section N` / `DESIGN N` is a section of DESIGN.md; README "X" is a README
    heading; every `python X.py` and `python -m a.b` command, markdown link and image names a file of the
    repository."""
    sections = {int(m) for m in re.findall(r"^## (\d+)\.", read(os.path.join(ROOT, "DESIGN.md")), re.M)}
    readme = headings("README.md")
    bad = []
    for path in TEXT_FILES:
        if path == os.path.abspath(__file__):  # this test's own patterns
            continue
        text, where = read(path), os.path.relpath(path, ROOT)
        for doc in re.findall(r"\b([A-Z][A-Za-z0-9_-]*\.md)\b", text):
            if not os.path.isfile(os.path.join(ROOT, doc)):
                bad.append(f"{where}: {doc} does not exist")
        for n in re.findall(r"\bDESIGN(?:\.md)?,? (?:sections? )?(\d+)", text):
            if int(n) not in sections:
                bad.append(f"{where}: DESIGN.md has no section {n}")
        for name in re.findall(r'\bREADME(?:\.md)? "([^"]+)"', text):
            if not any(h == name or h.startswith(name) for h in readme):
                bad.append(f'{where}: README has no section "{name}"')
        for script in re.findall(r"\bpython3? ([a-z_][\w/.-]*\.py)\b", text):
            if not os.path.isfile(os.path.join(ROOT, script)):
                bad.append(f"{where}: python {script}: no such file")
        for dotted in re.findall(r"\bpython3? -m ((?:generation|methods|retrieval|worlds|lab|perf|infra)[\w.]*)",
                                 text):
            if not os.path.isfile(module_path(dotted.rstrip("."))):
                bad.append(f"{where}: python -m {dotted}: no such module")
        if path.endswith(".md"):
            for link in re.findall(r"\]\(([^)#\s]+)", text):
                if "://" not in link and not os.path.exists(os.path.join(ROOT, link)):
                    bad.append(f"{where}: link {link} does not resolve")
    assert not bad, "\n".join(bad)


def deviation_ids() -> set:
    """Every id of DESIGN.md section 13's table: rows may name one id ("S1"), several ("F1, F2") or a range
    ("A1-A6", "C3-C5")."""
    text = read(os.path.join(ROOT, "DESIGN.md"))
    section = text[text.index("## 13."):]
    ids = set()
    for cell in re.findall(r"^\| ([A-Z][0-9A-Z ,-]*?) \|", section, re.M):
        for part in cell.split(","):
            m = re.fullmatch(r"([A-Z])(\d+)(?:-[A-Z]?(\d+))?", part.strip())
            if m:
                ids |= {f"{m.group(1)}{n}" for n in range(int(m.group(2)), int(m.group(3) or m.group(2)) + 1)}
    return ids


def test_every_deviation_tag_resolves_to_the_one_table():
    ids = deviation_ids()
    assert len(ids) > 50
    bad = []
    for path in sorted(MODULES.values()):
        for tag in re.findall(r"DEVIATION ([A-Z]\d+)", read(path)):
            if tag not in ids:
                bad.append(f"{os.path.relpath(path, ROOT)}: DEVIATION {tag} is not in DESIGN.md section 13")
    assert not bad, "\n".join(bad)
