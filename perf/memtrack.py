"""Live tensor bytes by category, counted as the code runs: what the memory ledger (perf/ledger.py)
measures with.

A `Tracker` is a TorchDispatchMode: every op's output storage is registered once (a view adds
nothing: storages are counted, not tensors), with its bytes rounded up as the CUDA caching allocator
rounds a block (512 bytes), and a weak reference whose callback removes it when the storage dies.
Each storage carries a category, decided when it is first seen by `classify` (the ledger reads the
Python stack: which function of the engine, the optimizer or the trainer is allocating) and
re-decided by `tag` for owners known by object (parameters, gradients, optimizer state). The tracker
keeps the live bytes per category, and per phase (`phase(name)`) the highest total and the
categories at that moment.

It runs on real tensors (the CPU runs of the ledger and of the tests) and on fake ones
(FakeTensorMode: the full-size forward and backward passes, no memory behind them); on a GPU,
`torch.cuda.memory_allocated` is the independent measure it is checked against (perf/gpucheck.py):
`CudaPhases` records the allocator's peak per phase there, as a Tracker does here.

It does not see memory outside torch's allocator (the CUDA context, NCCL, cuBLAS workspaces), the
allocator's cached free blocks or its fragmentation (the ledger adds those as estimates), nor
storages resized in place by other code than `UntypedStorage.resize_` (patched while tracking).
"""
import contextlib
import sys
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# bytes: the CUDA caching allocator's smallest block and its rounding unit
# (CUDACachingAllocator.cpp)
BLOCK = 512


def rounded(nbytes: int, block: int = BLOCK) -> int:
    """Bytes the allocator hands out for a request of nbytes (0 stays 0: no allocation)."""
    if nbytes == 0 or block <= 1:
        return nbytes
    return -(-nbytes // block) * block


class _Info:
    __slots__ = ("nbytes", "raw", "category", "ref")

    def __init__(self, nbytes, raw, category, ref):
        self.nbytes, self.raw, self.category, self.ref = nbytes, raw, category, ref


class Tracker(TorchDispatchMode):
    """Live storage bytes by category, with per-phase peaks (see the module docstring).

    classify: tensor -> category of a storage first seen now (default "other"); block: rounding unit
    (1: exact bytes); scale: {category: factor}: those categories count factor x their exact bytes
    (what a run of a smaller model predicts for a larger one), the others their rounded bytes;
    totals and peaks are of the scaled bytes.
    """

    def __init__(self, classify=None, block: int = BLOCK, scale=None):
        super().__init__()
        self.classify = classify or (lambda t: "other")
        self.block, self.scale = block, dict(scale or {})
        self.live = {}                 # id(storage) -> _Info
        self.bytes = Counter()         # category -> live (rounded) bytes
        # category -> live exact bytes (what a per-element count predicts)
        self.raw = Counter()
        self.count = Counter()         # category -> live storages
        self.total = 0                 # scaled live bytes
        # phase -> {"total": scaled bytes, "bytes": {category: scaled bytes}}
        self.peaks = {}
        self.current = None            # the phase now running (None: not recorded)
        self._resize = None

    # --- registration ---
    def _storages(self, t):
        # meta: shapes, no memory
        if isinstance(t, torch.Tensor) and not t.is_sparse and t.device.type != "meta":
            yield t.untyped_storage()

    def see(self, t, category=None):
        """Register t's storage if new (category: given, else classify()); returns its _Info or
        None."""
        for st in self._storages(t):
            info = self.live.get(id(st))
            if info is not None and info.ref() is st:
                return info
            cat = category or self.classify(t)
            raw = st.nbytes()
            info = _Info(rounded(raw, self.block), raw, cat, None)
            key = id(st)
            info.ref = weakref.ref(st, lambda _, key=key, info=info: self._gone(key, info))
            self.live[key] = info
            self._add(info, +1)
            return info
        return None

    def tag(self, tensors, category: str):
        """Count these tensors' storages under category from now on (registering any not yet seen).
        """
        for t in tensors:
            for st in self._storages(t):
                info = self.live.get(id(st))
                if info is None or info.ref() is not st:
                    self.see(t, category)
                elif info.category != category:
                    self._add(info, -1)
                    info.category = category
                    self._add(info, +1)

    def tag_all(self, category: str):
        """Count every live storage under category from now on (what a measurement has set up before
        it starts)."""
        for info in list(self.live.values()):
            if info.category != category:
                self._add(info, -1)
                info.category = category
                self._add(info, +1)

    def _gone(self, key, info):
        if self.live.get(key) is info:
            del self.live[key]
            self._add(info, -1)

    def _add(self, info, sign):
        self.bytes[info.category] += sign * info.nbytes
        self.raw[info.category] += sign * info.raw
        self.count[info.category] += sign
        self.total += sign * self._value(info.category, info.nbytes, info.raw)
        if sign > 0:
            self._peak()

    def _value(self, category, nbytes, raw):
        factor = self.scale.get(category)
        return nbytes if factor is None else factor * raw

    def scaled(self) -> dict:
        """{category: scaled live bytes} now."""
        return {c: self._value(c, self.bytes[c], self.raw[c]) for c in self.bytes if self.count[c]}

    def _peak(self):
        if self.current is None:
            return
        peak = self.peaks.get(self.current)
        if peak is None or self.total > peak["total"]:
            self.peaks[self.current] = {"total": self.total, "bytes": self.scaled()}

    @contextlib.contextmanager
    def hold(self, category: str, nbytes: int):
        """Count nbytes under category while the block runs, as if a storage of that size lived
        (what a larger model would allocate here: the ledger's activations at full size during a
        small probe's forward)."""
        info = _Info(int(nbytes), int(nbytes), category, None)
        self._add(info, +1)
        try:
            yield
        finally:
            self._add(info, -1)

    # --- phases ---
    @contextlib.contextmanager
    def phase(self, name: str):
        """Record the peak of what runs inside under `name` (its starting level counts: a phase with
        no allocation peaks at what was live when it began)."""
        saved, self.current = self.current, name
        self._peak()
        try:
            yield
        finally:
            self.current = saved

    def snapshot(self) -> dict:
        """{"total": scaled bytes, "bytes": {category: scaled bytes}} now."""
        return {"total": self.total, "bytes": self.scaled()}

    # --- the dispatch mode ---
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.see(t)
        return out

    def __enter__(self):
        original = self._resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):  # not an op: the dispatch mode would not see it
            result = original(st, size)
            info = tracker.live.get(id(st))
            if info is not None and info.ref() is st and info.raw != st.nbytes():
                tracker._add(info, -1)
                info.raw, info.nbytes = st.nbytes(), rounded(st.nbytes(), tracker.block)
                tracker._add(info, +1)
            return result
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)


def stack_classifier(table: dict, default: str = "other", depth: int = 60):
    """A classify() for Tracker: the category of the innermost frame on the Python stack whose code
    object is in table ({code: category}); default when none is."""
    def classify(t):
        f = sys._getframe(2)
        for _ in range(depth):
            if f is None:
                break
            cat = table.get(f.f_code)
            if cat is not None:
                return cat
            f = f.f_back
        return default
    return classify


class CudaPhases:
    """memprobe.phases' recorder on a GPU: per phase, the allocator's peak from the phase's start (a
    nested phase's peak counts for the outer one too), its reserved bytes and the device's used
    bytes at that peak's end."""

    def __init__(self):
        self.current, self.peaks, self._outer = None, {}, []

    @contextlib.contextmanager
    def phase(self, name):
        torch.cuda.synchronize()
        if self.current is not None:
            self._outer.append((self.current, torch.cuda.max_memory_allocated()))
        saved, self.current = self.current, name
        torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            peak = max(torch.cuda.max_memory_allocated(), self.peaks.get(name, {}).get("total", 0))
            self.peaks[name] = {
                "total": peak, "reserved": torch.cuda.max_memory_reserved(), "used": total - free
            }
            self.current = saved
            if saved is not None:
                outer, before = self._outer.pop()
                self.peaks.setdefault(outer, {"total": 0})
                self.peaks[outer]["total"] = max(self.peaks[outer]["total"], before, peak)
