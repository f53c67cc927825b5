"""Pinned CPU numerics: the math libraries' settings meant to make a world build or a CPU run
compute the same bits on every x86-64 CPU with AVX2 (DESIGN.md section 9; the experiment behind each
setting: RESULTS.md "Pinned numerics"). One kernel is not pinned by them: torch's sqrt, exp, log and
tanh of a float tensor go to MKL's vector math, whose sqrt gave other bits on emulated CPUs; that is
why the built worlds are committed (worlds/).

torch's own kernels (ATen), MKL (its matmuls), oneDNN (the encoder's GELU), numpy and FAISS each
pick their code by the CPU they find: AVX-512 on one machine, AVX2 on another, MKL's non-Intel paths
on an AMD CPU, and a second thread where there are two cores. Each choice moves the last bits of
some sums, and behaviour cloning compounds them into a different world (the chains world built on an
AMD EPYC missed a warm-start target that it meets here). `PINS` fixes every such choice to one that
all x86-64 CPUs with AVX2 run alike. The libraries read these settings when they load, so this
module pins them at import and must be imported before numpy and torch: worlds/build.py,
train_twice.py and lab/audit.py import it first. `problems()` checks what is in force once torch has
loaded; `require()` refuses to go on with a problem, or only warns with ALLOW_UNPINNED=1.

It knows nothing of GPUs (CUDA kernels are pinned by other means, or not at all) and cannot pin a
CPU that is not x86-64 or has no AVX2 (an ARM laptop): there `require()` says so. It does not pin
the system's libm, which the pinned kernels do not call (a build with glibc's FMA variants masked is
identical: RESULTS.md).

Launch:
  python -m infra.numerics          # the pins, what is in force in a fresh process, and any problem (exit status 1)
  python -m perf.probe              # and the digests of the pinned kernels (perf/probe.py)
"""
import os
import platform
import sys

PINS = {
    # one thread: with two, some kernels split their sums by thread and the bits vary from run to
    # run
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    # ATen's AVX2 kernels: exact division and square root, transcendental functions from the Sleef
    # that torch bundles ("default" would call the system's libm, whose version and FMA variant are
    # the machine's)
    "ATEN_CPU_CAPABILITY": "avx2",
    # MKL's conditional numerical reproducibility: COMPATIBLE (SSE2 without the approximate rcpps /
    # rsqrtps) is the one branch Intel documents as giving the same results on non-Intel CPUs; AVX2
    # silently falls back to AUTO there
    "MKL_CBWR": "COMPATIBLE",
    # oneDNN's JIT kernels (the MiniLM encoder's GELU): the AVX2 code on every CPU that has it
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    # FAISS's distance kernels and the OpenBLAS of FAISS and numpy, and numpy's own SIMD loops:
    # their AVX2 code. No effect measured on the current worlds (a near tie in retrieval scores
    # would be one), pinned as they cost nothing
    "FAISS_SIMD_LEVEL": "AVX2",
    "OPENBLAS_CORETYPE": "Haswell",
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",
}
ALLOW = "ALLOW_UNPINNED"  # ALLOW_UNPINNED=1: go on (with a warning) where the pins are not in force
LIBRARIES = ("numpy", "torch", "faiss")  # read PINS when they load
MKL_BRANCHES = {
    0: "OFF",
    1: "OFF",
    2: "AUTO",
    3: "COMPATIBLE",
    4: "SSE2",
    6: "SSSE3",
    7: "SSE4_1",
    8: "SSE4_2",
    # mkl_cbwr_get's constants (mkl_types.h)
    9: "AVX",
    10: "AVX2",
    12: "AVX512",
    14: "AVX512_E1"
}

# the libraries already loaded when this module was first imported: for them the pins come too late
LOADED_BEFORE = [m for m in LIBRARIES if m in sys.modules]


def allowed() -> bool:
    return os.environ.get(ALLOW, "").strip().lower() in ("1", "true", "yes")


def pin() -> list:
    """Set PINS in the environment unless a library that reads them has loaded (then change
    nothing); returns the variables whose earlier value was replaced, as 'NAME=old'."""
    if LOADED_BEFORE:
        return []
    replaced = [f"{k}={os.environ[k]}" for k, v in PINS.items() if os.environ.get(k, v) != v]
    os.environ.update(PINS)
    return replaced


def mkl_branch() -> str:
    """MKL's reproducibility branch in force ("COMPATIBLE" when pinned); "unknown" where torch has
    no MKL."""
    import ctypes
    import torch
    # torch links MKL statically; the service call behind mkl_cbwr_get(MKL_CBWR_BRANCH) is what it
    # exports
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        code = lib.mkl_serv_cbwr_get(1)
    except (OSError, AttributeError):
        return "unknown"
    return MKL_BRANCHES.get(code, str(code))


def state() -> dict:
    """What the libraries run with now (loads torch and faiss): ATen's kernels, threads, MKL's
    branch, FAISS's SIMD."""
    import faiss
    import torch
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(), "mkl_branch": mkl_branch(),
        "faiss_simd": faiss.SIMDConfig.get_level_name()
    }


def problems() -> list:
    """Every way in which the pins are not in force in this process, in words (empty: pinned)."""
    out = []
    if platform.machine().lower() not in ("x86_64", "amd64"):
        out.append(
            f"this CPU is {platform.machine()}, not x86-64: the pins hold on x86-64 CPUs with AVX2 only"
        )
    if LOADED_BEFORE:
        out.append(
            f"{', '.join(LOADED_BEFORE)} loaded before infra/numerics.py, too early for the pins (run the script "
            "in a fresh process: it imports numerics first)")
    else:
        out += [
            f"{k}={os.environ.get(k)!r} in the environment, pinned {v!r}" for k, v in PINS.items()
            if os.environ.get(k) != v
        ]
    now = state()
    want = {
        "cpu_capability": "AVX2", "threads": 1, "mkl_branch": "COMPATIBLE", "faiss_simd": "AVX2"
    }
    hint = {"cpu_capability": "" if LOADED_BEFORE else " (does this CPU have AVX2?)"}
    out += [f"{k} is {now[k]}, pinned {v}{hint.get(k, '')}" for k, v in want.items() if now[k] != v]
    return out


def describe() -> dict:
    """The numerics a world or a run was made with (identical on every pinned machine): state() and
    `pinned`."""
    return {"pinned": not problems(), **state()}


def require(what: str) -> bool:
    """True when the pins are in force; otherwise SystemExit naming every problem, or
    (ALLOW_UNPINNED=1) a warning on stderr and False."""
    found = problems()
    if not found:
        return True
    msg = (
        f"numerics: {what} is not on pinned numerics, so its numbers are this machine's own:\n  - "
        + "\n  - ".join(found))
    if allowed():
        print(f"{msg}\n  ({ALLOW}=1: going on)", file=sys.stderr, flush=True)
        return False
    raise SystemExit(
        f"{msg}\nSet {ALLOW}=1 to go on with numbers that other machines will not reproduce.")


for _note in pin():
    print(f"numerics: {_note} replaced by the pinned value", file=sys.stderr)


if __name__ == "__main__":
    import argparse
    import json
    argparse.ArgumentParser(description="Print the pins, what is in force in this fresh process, and "
                            "any problem (exit status 1). The kernels' digests: python -m perf.probe."
                            ).parse_args()
    print(json.dumps({"pins": PINS, "in_force": state()}, indent=1))
    issues = problems()
    print("\n".join(["problems:"] + [f"  - {p}" for p in issues]) if issues else "pinned: no problem")
    raise SystemExit(1 if issues else 0)
