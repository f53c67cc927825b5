"""The layout reads one way (DESIGN.md section 2): no import cycle among the top-level modules (imports inside
functions included), and every script answers --help."""
import ast
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "*.py")))
ORDER = ["config", "retriever", "protocol", "sampler", "engine", "credit", "logprobs", "rollout", "eval", "baselines",
         "learned", "methods", "report", "checkpoint", "train_twice", "audit"]


def imports_of(module: str) -> set:
    """Every top-level project module that `module` imports, anywhere in the file."""
    tree = ast.parse(open(os.path.join(ROOT, module + ".py"), encoding="utf-8").read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(MODULES) - {module}


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


def test_the_method_chain_imports_one_way():
    """protocol, sampler <- engine <- rollout <- eval <- train_twice <- audit: a module imports only those before it."""
    for i, m in enumerate(ORDER):
        later = imports_of(m) & set(ORDER[i + 1:])
        assert not later, f"{m} imports {later}, which come after it in {ORDER}"


@pytest.mark.parametrize("script", ["train_twice.py", "audit.py", "eval.py", "report.py", "world.py", "data.py",
                                    "retriever.py", "server.py"])
def test_every_script_answers_help(script):
    for flag in ("--help", "-h"):
        proc = subprocess.run([sys.executable, os.path.join(ROOT, script), flag], capture_output=True, text=True,
                              cwd=ROOT, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "usage" in proc.stdout.lower()


def test_train_help_lists_every_field_with_default_and_comment():
    import train_twice as tt
    text = subprocess.run([sys.executable, os.path.join(ROOT, "train_twice.py"), "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120).stdout
    for f in tt.Config.__dataclass_fields__.values():
        line = next(x for x in text.splitlines() if x.strip().startswith(f"--{f.name}="))
        assert repr(f.default) in line and len(line.split(")  ", 1)[-1]) > 3, line  # default and its comment


def test_bad_value_exits_with_a_message_not_a_traceback():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_twice.py"), "--micro_batch_size=0"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "micro_batch_size=0 (must be >= 1)" in proc.stderr
    assert "Traceback" not in proc.stderr
