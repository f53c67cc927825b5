"""Time for the first-GPU check (perf/gpucheck.py): what a part should take on one H100, derived
from its bytes, FLOPs and kernel launches, and a part run in a process of its own that is stopped
at its deadline.

  python -m perf.gpucheck --plan     # each part's estimate (these functions) and its budget

The estimates: a decode step reads the bf16 weights and every slot's cached keys and values over
the HBM's bandwidth and, when eager, pays each layer's kernel launches and the step's host work; a
training pass does 2 FLOPs per parameter and position (6 in all for the two log-prob forwards and
the update's forward, recompute and backward) at a share of the bf16 peak; a part's start and
torch.compile cost what H100 says. The rates are nominal ones derated, the rest assumed: the check's
JSON records each part's seconds beside its estimate, so the first run on a GPU corrects them.

A Part is a forked child: it shares everything its parent imported (no second import), its own
CUDA context and allocator die with it (an out-of-memory or CUDA error ends that part only), and
what it has measured so far is on disk when it is stopped. The parent must not start CUDA itself
(a forked child could not use it then): it only waits.

It knows nothing of what a part measures.
"""
import json
import multiprocessing
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
# one H100 SXM as the estimates see it: the nominal rates (HBM3 3.35 TB/s, 989 TFLOP/s dense
# bf16) derated, and the costs no rate gives (assumed)
H100 = dict(
    bytes_s=3.0e12,   # HBM reads, ~90% of nominal
    flops_s=3.0e14,   # a training step's bf16 matmuls, ~30% of nominal (micro-batches of 8)
    launch_s=3e-4,    # eager launches of one decoder layer (~30 kernels x ~10 us); none in a graph
    step_s=1.5e-3,    # an eager decode step's host work besides the layers (draw, stops, records)
    compile_s=30.0,   # torch.compile of the keyed draw, once per process
    start_s=10.0)     # a part's start: CUDA context, the random model's init on the GPU


def mean_turn(median: float, cap: int) -> float:
    """Mean length of turns geometric with `median`, cut at `cap` (bench_engine.eos_biased's)."""
    q = 0.5 ** (1 / median)  # a token is not EOS
    return (1 - q ** cap) / (1 - q)


def decode_s(tokens: float, slots: int, tail: int, weight_bytes: float, kv_bytes: float,
             layers: int, graphs: bool) -> float:
    """Seconds to decode `tokens` over `slots` slots: full slots, then the last rows' tail of up to
    `tail` steps; each step reads the weights and kv_bytes of every slot's cache and, eager,
    launches every layer's kernels."""
    launch = 0 if graphs else layers * H100["launch_s"] + H100["step_s"]
    return (tokens / slots + tail) * ((weight_bytes + slots * kv_bytes) / H100["bytes_s"] + launch)


def pass_s(params: float, positions: float, passes: float = 1) -> float:
    """Seconds of `passes` forwards of `params` parameters over `positions` positions."""
    return passes * 2 * params * positions / H100["flops_s"]


class Part:
    """fn(report) in a forked process: report(**figures) writes what it has so far to a file, so a
    part stopped at its deadline keeps them."""

    def __init__(self, name: str, fn, folder: str):
        assert not torch.cuda.is_initialized(), "perf/budget.py: CUDA started in the parent"
        self.name, self.path, self.t0 = name, os.path.join(folder, f"{name}.json"), time.time()
        sys.stdout.flush()
        sys.stderr.flush()  # else the child prints what is buffered again
        self.proc = multiprocessing.get_context("fork").Process(target=_child, args=(fn, self.path),
                                                                name=name)
        self.proc.start()

    def wait(self, seconds: float) -> dict:
        """Its figures once it ends, or once `seconds` have passed (then it is killed), with "s"
        (its seconds) and "stopped" or "error" when it did not finish."""
        self.proc.join(max(0.0, seconds))
        stopped = self.proc.is_alive()
        if stopped:
            self.proc.kill()
            self.proc.join()
        got = {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                got = json.load(f)
        got["s"] = time.time() - self.t0
        if stopped:
            got["stopped"] = f"over its budget: stopped after {got['s']:.0f} s"
        elif self.proc.exitcode and "error" not in got:
            got["error"] = f"its process ended with status {self.proc.exitcode}"
        return got


def _child(fn, path: str):
    got = {}

    def report(**figures):
        got.update(figures)
        with open(path + ".tmp", "w") as f:
            json.dump(got, f)
        os.replace(path + ".tmp", path)
    try:
        fn(report)
        report(cpu_s=time.process_time())  # this process's CPU seconds (a forked child's start at 0)
    except Exception as e:  # the part's finding (an out-of-memory error included) is its result
        at = traceback.extract_tb(e.__traceback__)[-1]
        report(error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]} "
                     f"({os.path.relpath(at.filename, ROOT)}:{at.lineno})")
        sys.exit(1)
