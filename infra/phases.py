"""A training step's phases: when each ended and, on a GPU, the memory each took (DESIGN.md section 10).

    times = Phases()          # the step starts
    ...; times.mark("rollout")  # ... each phase ends: its seconds, its peak allocated bytes, the device's used bytes
    metrics.update(times.metrics(accel))  # time_<phase>, time; on CUDA mem_<phase>_gib, used_<phase>_gib per rank

The memory figures are what the memory ledger predicts per phase (perf/ledger.py): the peak of torch's
allocator within the phase (torch.cuda.max_memory_allocated, reset at each mark) and the device's used
bytes at its end (mem_get_info: every process on the GPU, the retriever server's shard included). They
are lists, one figure per rank; `python -m perf.smoke` holds them against the ledger. On a CPU there are
none, and a mark costs a clock read.
"""
import time

import torch

GIB = 1 << 30


class Phases(dict):
    """{"start": t0, phase: the time it ended, ...} in the order of the marks."""

    def __init__(self):
        super().__init__(start=time.time())
        self.memory = {}  # phase -> (peak allocated bytes, used device bytes at its end)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def mark(self, phase: str):
        self[phase] = time.time()
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            self.memory[phase] = (torch.cuda.max_memory_allocated(), total - free)
            torch.cuda.reset_peak_memory_stats()

    def metrics(self, accel) -> dict:
        """time_<phase> (seconds) and time (the step's); with memory, mem_<phase>_gib and
        used_<phase>_gib, each a list over ranks."""
        names = list(self)
        out = {f"time_{b}": self[b] - self[a] for a, b in zip(names, names[1:])}
        out["time"] = self[names[-1]] - self["start"]
        if self.memory:
            mine = torch.tensor([v for p in self.memory for v in self.memory[p]],
                                dtype=torch.float64, device=accel.device)
            every = accel.gather(mine[None]).reshape(accel.num_processes, -1).cpu() / GIB
            for k, phase in enumerate(self.memory):
                out[f"mem_{phase}_gib"] = [round(float(x), 3) for x in every[:, 2 * k]]
                out[f"used_{phase}_gib"] = [round(float(x), 3) for x in every[:, 2 * k + 1]]
        return out
