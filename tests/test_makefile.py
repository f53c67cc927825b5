"""Makefile: paths with spaces and quotes reach every command as one argument. The dry runs (`make -n`) print what
the shell would run; each printed line is split as a shell splits it (shlex) and the path must come out whole."""
import os
import shlex
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}


def make(*args, dry=True) -> str:
    proc = subprocess.run(["make", "--no-print-directory", *(["-n"] if dry else []), *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def words(text: str) -> list:
    """Every shell word of every printed command (continuation lines joined; `== step` lines are make's notes)."""
    lines = text.replace("\\\n", " ").splitlines()
    return [w for line in lines if line.strip() and not line.startswith("== ") for w in shlex.split(line)]


def after(ws: list, word: str, start: str = "") -> str:
    """The word after `word`, in the command that starts at the last `start` word (a script name)."""
    i = len(ws) - 1 - ws[::-1].index(start) if start else 0
    return ws[ws.index(word, i) + 1]


def test_paths_with_spaces_and_quotes_arrive_whole(tmp_path):
    base = str(tmp_path / "a b'c")  # a space and a single quote
    world, venv, model = f"{base}/world", f"{base}/venv", f"{base}/my policy"
    paths = [f"WORLD={world}", f"VENV={venv}", f"MODEL={model}"]
    py = f"{venv}/bin/python"
    demo = words(make("demo", *paths))
    assert demo[demo.index("venv") + 1] == venv  # python3 -m venv <VENV>
    assert demo[demo.index("--out", demo.index("worlds.build")) + 1] == world  # the build
    assert after(demo, "--verify", "worlds.build") == world and after(demo, "configs/demo.cfg") == f"--world={world}"
    assert demo.count(py) >= 5  # pip twice, worlds/build.py (build, then the check against worlds.lock), train_twice.py
    ev = words(make("eval", *paths))
    assert [after(ev, flag, "eval.py") for flag in ("--model", "--data", "--index")] == [
        model, f"{world}/test.jsonl", f"{world}/index"]
    audit = words(make("audit", *paths))
    assert after(audit, "--world", "lab.audit") == world and after(audit, "--out", "lab.audit") == "runs/audit-world"
    assert after(audit, "--verify", "worlds.build") == world
    audit = words(make("audit", f"WORLD={base}/my world", f"AUDIT_OUT={base}/audit out"))
    assert after(audit, "--out", "lab.audit") == f"{base}/audit out"
    assert words(make("audit", f"WORLD={base}/my world"))[-1] == "runs/audit-my world"  # the default, from WORLD
    idx = words(make("index", *paths))
    assert after(idx, "--corpus", "retriever.py") == f"{world}/corpus.jsonl" and idx[-1] == f"{world}/index"
    cmp = f"{base}/compare"
    dc = words(make("demo-compare", *paths, f"COMPARE={cmp}", "SEEDS=0"))
    assert f"--out_dir={cmp}/omega$o-seed$s" in dc and f"{cmp}/omega*-seed*" in dc
    cm = words(make("compare-methods", *paths, f"CMP={cmp}", "SEEDS=0 1", "METHODS=grpo twice"))
    assert cm[cm.index("mkdir") + 2] == cmp and f"{cmp}/$m-seed$s/metrics.jsonl" in cm
    assert {f"cmp={cmp}", f"world={world}", f"py={py}"} <= set(cm)  # the sh -c script reads them from its environment
    assert after(cm, "--verify", "worlds.build") == world and after(dc, "--verify", "worlds.build") == world
    assert after(words(make("compare-methods", "SEEDS=0", "METHODS=grpo")), "--verify", "worlds.build") == "data/chains"
    script = cm[cm.index("-c") + 1]
    assert base not in script and '--out_dir="$cmp/$0-seed$1"' in script
    for m, s in (("grpo", 0), ("twice", 1)):
        assert cm.count(f"{cmp}/{m}-seed{s}") == 2  # lab/report.py methods and lab/report.py paired


def test_reproduce_dry_run_with_spaces_in_sr1_and_runs(tmp_path):
    sr1, runs = str(tmp_path / "s r1"), str(tmp_path / "my runs")
    run = f"{runs}/qwen2.5-3b"
    w = words(make("reproduce-3b", "DRY_RUN=1", f"SR1={sr1}", f"RUNS={runs}", dry=False))
    assert after(w, "--out", "worlds.data") == sr1 and after(w, "--index", "retrieval.server") == f"{sr1}/index"
    assert f"--out_dir={run}-grpo" in w and f"--out_dir={run}-twice" in w
    assert f"{run}-grpo/step_??????" in w and f"{run}-twice/DONE" in w  # resume look-up, DONE stamp
    assert after(w, "--data", "eval.py") == f"{sr1}/test/$t.jsonl" and f"{run}-twice/eval/$t.json" in w
    assert after(w, "--out", "lab.report") == f"{run}-report.md" and f"GRPO={run}-grpo/eval" in w
    assert f"{runs}/retriever.pid" in w and f"{run}-twice/eval/DONE" in w
    assert not os.path.exists(sr1) and not os.path.exists(runs)  # nothing ran


def test_retriever_down_stops_the_server_of_a_runs_folder_with_a_space(tmp_path):
    """Run for real: the pid file under a folder with a space is read, its process stopped, the file removed."""
    runs = tmp_path / "my runs"
    runs.mkdir()
    proc = subprocess.Popen(["sleep", "60"])
    try:
        (runs / "retriever.pid").write_text(f"{proc.pid}\n")
        make("retriever-down", f"RUNS={runs}", dry=False)
        t = time.time()
        while proc.poll() is None and time.time() - t < 10:
            time.sleep(0.05)
        assert proc.poll() is not None and not (runs / "retriever.pid").exists()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_two_node_commands_fill_the_placeholders(tmp_path):
    """make train-2nodes on node 1: ZeRO-2's config (both sizes: DDP does not fit, memory.json) widened to two
    machines, its machine rank, main address and port from the variables, both nodes query the retriever on node 0,
    and the run folder arrives whole."""
    out = str(tmp_path / "shared runs/two nodes")
    w = words(make("train-2nodes", "SIZE=3b", "NODE_RANK=1", "MAIN_IP=10.1.2.3", "MAIN_PORT=29600", f"OUT={out}",
                   "ARGS=--steps=3"))
    assert [after(w, flag, "launch") for flag in ("--config_file", "--num_machines", "--machine_rank",
                                                  "--main_process_ip", "--main_process_port")] == [
        "configs/accelerate_zero2.yaml", "2", "1", "10.1.2.3", "29600"]
    assert {f"--out_dir={out}", "--retriever_url=http://10.1.2.3:8000/retrieve", "--steps=3"} <= set(w)
    assert f"{out}/step_??????" in w  # continues from its last checkpoint
    assert after(words(make("retriever-up", "RHOST=10.1.2.3")), "--host", "retrieval.server") == "10.1.2.3"
