"""The same results on every x86-64 CPU, checked in one command (DESIGN.md section 9): the probe's
digests (perf/probe.py), both built-in worlds and a credit-suite world at test scale, two TWICE steps on the tiny one,
computed natively and under QEMU's emulation of other CPU models, then compared with each other and
with worlds/worlds.lock.

  python -m perf.cpucheck                                   # native + three emulated CPUs
  python -m perf.cpucheck --cpus native,Skylake-Client-v4   # a chosen list ('native': this CPU)

Emulation runs every instruction in software (QEMU user mode, `apt install qemu-user`): a test-scale
world takes minutes there. What it shows is that the code takes no CPU-dependent path; it cannot
show what a real CPU's approximate instructions compute, which is why the build avoids MKL's
square root (infra/adamw.py) rather than matching one CPU's. Exit status 1 on any difference.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
CPUS = ("native", "Skylake-Client-v4", "Icelake-Server-v6", "EPYC-Milan-v1")
TRAIN = ["--steps=2", "--prompts_per_step=4", "--group_size=3", "--max_new_tokens=24",
         "--max_turns=2", "--max_context=768", "--lr=1e-4", "--micro_batch_size=6", "--eval_size=6",
         "--eval_every=1", "--gen_batch_size=32", "--log_tensorboard=false"]


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


# the worlds built at test scale on every CPU: both presets and a credit-suite world (its scripts' other branches)
WORLDS = ("tiny", "chains", "luck-high")


def on_cpu(cpu: str, out: str) -> dict:
    """Everything one CPU computes, as digests: each command in its own process, natively or under
    `qemu-x86_64 -cpu CPU` (QEMU's user mode does not follow a child process, so every command is
    started under it here, none from inside another)."""
    qemu = [] if cpu == "native" else [shutil.which("qemu-x86_64") or "qemu-x86_64", "-cpu", cpu]
    env = {**os.environ, "ALLOW_UNPINNED": "1"}  # a difference is reported below, not refused
    printed = run(qemu + [sys.executable, "-m", "perf.probe"], env).stdout  # JSON, then a verdict
    probed = json.JSONDecoder().raw_decode(printed)[0]["probe"]
    found = {f"probe/{k}": v for k, v in probed.items() if k != "vml_sqrt"}  # MKL's: CPU-dependent
    from worlds import lock
    for preset in WORLDS:
        world = os.path.join(out, preset)
        run(qemu + [sys.executable, "-m", "worlds.build", "--out", world, "--preset", preset,
                    "--scale", "test", "--force"], env)
        found.update({f"{preset}/{k}": v[:12] for k, v in lock.world_digests(world).items()})
    run_dir = os.path.join(out, "run")
    run(qemu + [sys.executable, "train_twice.py", "configs/demo.cfg",
                f"--world={os.path.join(out, 'tiny')}", f"--out_dir={run_dir}", "--overwrite",
                *TRAIN], env)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    keep = ("step", "reward", "eval_em", "kl", "loss", "grad_norm", "twins", "factual_tokens",
            "aux_tokens", "sigma", "weight_norm")
    found["run/metrics"] = hashlib.sha256(json.dumps([{k: r.get(k) for k in keep} for r in rows])
                                          .encode()).hexdigest()[:12]
    last = max(d for d in os.listdir(run_dir) if d.startswith("step_"))
    found["run/policy"] = digest(os.path.join(run_dir, last, "policy", "model.safetensors"))
    return found


def run(cmd, env):
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return proc


def compare(results: dict) -> list:
    """Lines of the table (what differs between CPUs, or from worlds.lock), and the verdict."""
    from worlds import lock
    locked = {}
    for preset in WORLDS:
        entry = lock.read_lock().get((preset, 0, "test"), {})
        locked.update({f"{preset}/{k}": v[:12] for k, v in entry.items()})
    keys = sorted({k for r in results.values() for k in r})
    bad = []
    for key in keys:
        values = {cpu: r.get(key) for cpu, r in results.items()}
        want = locked.get(key)
        if len(set(values.values())) > 1 or (want and any(v != want for v in values.values())):
            bad.append(f"{key}: " + ", ".join(f"{c} {v}" for c, v in values.items()) +
                       (f" (worlds.lock {want})" if want else ""))
    return bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.cpucheck",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--cpus", default=",".join(CPUS),
                        help="comma-separated: native and QEMU models")
    parser.add_argument("--out", default="",
                        help="folder for the results (default: a temporary one)")
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="cpucheck-")
    results = {}
    for cpu in args.cpus.split(","):
        results[cpu] = on_cpu(cpu, os.path.join(out, cpu))
        print(f"{cpu}: {len(results[cpu])} digests", flush=True)
    with open(os.path.join(out, "cpucheck.json"), "w") as f:
        json.dump(results, f, indent=1)
    bad = compare(results)
    print("\n".join(bad) if bad else
          f"every digest is the same on {', '.join(results)} and matches worlds.lock")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
