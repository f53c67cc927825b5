"""The node check: what a node of several GPUs adds to the first-GPU check (perf/gpucheck.py),
measured in a few minutes before any long run, each figure beside the memory ledger's
(DESIGN.md section 10).

  make gpu-check GPUS=8     # the one-GPU check, then torchrun --nproc_per_node 8 -m perf.nodecheck
  DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 -m perf.nodecheck --tiny --out F   # CPU ranks: a test

Every rank, in order (rank 0 writes one JSON with every rank's figures; exit status 1 unless ok):
  1. context: device memory in use outside torch's allocator (mem_get_info's used bytes less the
     allocator's reserved ones) once CUDA is up, after the first all-reduce (NCCL builds its
     communicator's ring, tree and NVLS buffers then) and after the ZeRO-2 step (cuBLAS's
     workspaces), against ledger.CONTEXT_GIB (4.0 GiB budgeted).
  2. all-reduce: a sum over the ranks checked exactly, then the bus bandwidth of all-reduces at
     three sizes (nccl-tests' busbw: 2 (n - 1) / n x bytes / seconds).
  3. ZeRO-2: DeepSpeed with configs/deepspeed_zero2.json's ZeRO settings (--tiny: 1e5-element
     buckets), bf16, torch's AdamW, on a Qwen2.5-3B-wide model cut to --layers layers (--tiny: a
     small Qwen2), two steps of two micro-batches: the storages DeepSpeed's ZeRO code allocates
     (memtrack.Tracker, as ledger.zero2_static was fitted on CPU ranks) when steady, at the second
     backward's peak and at its step, against zero2_static; the step's seconds.
  4. retriever: the server's own loading (retrieval/dense.load_vectors: the flat index sharded over
     every GPU in float16 with FAISS's scratch; on the CPU its float16 copy) of --index_rows random
     unit vectors, by rank 0 while every rank still holds its model and optimizer; then --queries
     of its rows searched: each GPU's memory taken against the ledger's shard, scratch and context
     for that many rows (ledger.SERVER_GIB), queries per second, and every query finds itself.
ok: every part ran, the sum is exact, each query found itself, the context and the index took at
most the ledger's figures, ZeRO-2's steady bytes and step are within --margin of zero2_static and
its backward at most it (zero2_static is an upper bound there).
"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

from perf import ledger
from perf import memtrack
import train_twice as tt

GIB = 2 ** 30
ROOT = ledger.ROOT
# a Qwen2 small enough for CPU ranks (two CPU ranks run it in the test suite)
TINY = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def _device(tiny: bool):
    if not tiny and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def outside(device):
    """GiB of this GPU in use outside torch's allocator (None on the CPU)."""
    total = used(device)
    return None if total is None else total - torch.cuda.memory_reserved(device) / GIB


def used(device):
    """GiB of this GPU in use by every process (None on the CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / GIB


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_reduce(device, sizes, iters: int = 5) -> dict:
    """The sum checked exactly, then {bytes: bus GB/s} (the mean of `iters` after 2 warm-ups)."""
    dist = torch.distributed
    n, rank = dist.get_world_size(), dist.get_rank()
    x = torch.full((1 << 16,), float(rank + 1), device=device)
    dist.all_reduce(x)
    exact = bool((x == n * (n + 1) / 2).all())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # gloo: float32
    bandwidth = {}
    for size in sizes:
        y = torch.ones(size // torch.empty((), dtype=dtype).element_size(), dtype=dtype,
                       device=device)
        for _ in range(2):
            dist.all_reduce(y)
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(y)
        _sync(device)
        seconds = (time.perf_counter() - start) / iters
        bandwidth[str(size)] = 2 * (n - 1) / n * size / seconds / 1e9
        del y
    return {"exact": exact, "busbw_gbs": bandwidth}


def zero2(dims: dict, device, bucket: int, seq: int = 64) -> dict:
    """DeepSpeed ZeRO-2 (bf16, overlap_comm, torch's AdamW), two steps of two micro-batches: the
    storages DeepSpeed's ZeRO code allocates, steady, at the second backward's peak and at its
    step, beside ledger.zero2_static; the second step's seconds."""
    import deepspeed
    from transformers import Qwen2Config, Qwen2ForCausalLM
    if device.type == "cpu":  # --tiny: gloo's all-reduce, not DeepSpeed's shared-memory op for CPU ranks (a C++ op
        # compiled on a machine's first use, ~30 s a rank; a GPU node's ranks use NCCL and never build it)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**dims))
    numels = [p.numel() for p in model.parameters()]
    zero = json.load(open(os.path.join(ROOT, "configs", "deepspeed_zero2.json")))["zero_optimization"]
    if bucket:
        zero = {**zero, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    ds = {"zero_optimization": zero, "bf16": {"enabled": True}, "gradient_accumulation_steps": 2,
          "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 9}

    # ZeRO's own storages: not the forward's, nor the backward's that engine.backward runs
    def owner(t):
        f = sys._getframe(2)
        while f is not None and not any(part in f.f_code.co_filename
                                        for part in ("/deepspeed/", "/transformers/")):
            f = f.f_back
        return "deepspeed" if f is not None and "/deepspeed/runtime/zero/" in f.f_code.co_filename else "other"
    tracker = memtrack.Tracker(owner, block=1, scale={"other": 0.0})
    ids = torch.randint(0, dims["vocab_size"], (2, seq), device=device)
    with tracker:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(
            model.parameters()), config=ds)
        for step in range(2):
            _sync(device)
            start = time.perf_counter()
            for micro in range(2):
                with tracker.phase(f"update{step}"):
                    engine.backward(engine(input_ids=ids, labels=ids).loss)
                with tracker.phase(f"step{step}"):
                    engine.step()
            _sync(device)
            seconds = time.perf_counter() - start
        steady = tracker.total
    cfg = tt.Config()
    pred = ledger.zero2_static(sum(numels), max(numels), world, ledger.adamw_step(
        cfg, [-(-sum(numels) // world)]), {"zero_optimization": zero})
    out = {"params": sum(numels), "steady": steady, "update": tracker.peaks["update1"]["total"],
           "step": tracker.peaks["step1"]["total"], "step_s": seconds, "predicted": {
               k: sum(pred[p].values())
               for k, p in (("steady", "rollout"), ("update", "update"), ("step", "optimizer_step"))}}
    del engine, model
    return out


def retriever(device, rows: int, queries: int, gpus: int) -> dict:
    """Rank 0 loads `rows` random unit vectors as the server does and searches `queries` of them
    while every rank measures its GPU's memory before and after (the caller's barriers)."""
    import faiss
    from retrieval import dense
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((rows, ledger.WIKI18[1]), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    flat = faiss.IndexFlatIP(vectors.shape[1])
    flat.add(vectors)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "flat.index")
        faiss.write_index(flat, path)
        del flat
        start = time.perf_counter()
        _, index, resources = dense.load_vectors(path, {"n_rows": rows, "dim": vectors.shape[1]},
                                                 gpu=device.type == "cuda", fp16=True)
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        _, found = index.search(vectors[:queries], 3)
        search_s = time.perf_counter() - start
    return {"index": index, "resources": resources, "load_s": load_s,
            "queries_per_s": queries / search_s,
            "self_found": bool((found[:, 0] == np.arange(queries)).all()),
            "predicted_per_gpu_gib": rows * vectors.shape[1] * 2 / max(gpus, 1) / GIB
            + dense.FAISS_TEMP / GIB + ledger.SERVER_GIB["context"]}


def check(args) -> dict:
    """Every part on this rank, in order; rank 0 gets every rank's figures."""
    dist = torch.distributed
    device = _device(args.tiny)
    fig = {"outside_gib": {"cuda": outside(device)}}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            **({"device_id": device} if device.type == "cuda" else {}))
    n, rank = dist.get_world_size(), dist.get_rank()
    sizes = [1 << 16, 1 << 20, 1 << 22] if device.type == "cpu" else [1 << 23, 1 << 27, 1 << 30]
    fig["all_reduce"] = all_reduce(device, sizes)
    fig["outside_gib"]["nccl"] = outside(device)
    dims = TINY if args.tiny else {**ledger.QWEN["3b"], "num_hidden_layers": args.layers}
    fig["zero2"] = zero2(dims, device, 100_000 if args.tiny else 0)
    fig["outside_gib"]["zero2"] = outside(device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    dist.barrier()
    before = used(device)
    dist.barrier()
    found = retriever(device, args.index_rows, args.queries, gpus) if rank == 0 else None
    dist.barrier()
    fig["retriever_gib"] = None if before is None else used(device) - before
    if found is not None:
        fig["retriever"] = {k: v for k, v in found.items() if k not in ("index", "resources")}
    del found
    every = [None] * n
    dist.all_gather_object(every, fig)
    dist.destroy_process_group()
    return {"world": n, "device": str(device.type), "ranks": every}


def verdict(result: dict, margin: float) -> dict:
    """ok and the reasons it is not (module docstring)."""
    ranks, why = result["ranks"], []
    budget = sum(ledger.CONTEXT_GIB.values())
    for r, fig in enumerate(ranks):
        if not fig["all_reduce"]["exact"]:
            why.append(f"rank {r}: the all-reduce's sum is wrong")
        worst = max((v for v in fig["outside_gib"].values() if v is not None), default=None)
        if worst is not None and worst > budget:
            why.append(f"rank {r}: {worst:.2f} GiB outside the allocator > the ledger's {budget:.2f}")
        z = fig["zero2"]
        for k, pred in z["predicted"].items():
            got = z[k]
            if (got > pred * (1 + margin)) or (k != "update" and got < pred * (1 - margin)):
                why.append(f"rank {r}: ZeRO-2 {k} {got / GIB:.3f} GiB against zero2_static's "
                           f"{pred / GIB:.3f}")
    server = ranks[0].get("retriever", {})
    if not server.get("self_found"):
        why.append("retriever: a query did not find its own row")
    pred = server.get("predicted_per_gpu_gib", 0)
    for r, fig in enumerate(ranks):
        took = fig["retriever_gib"]
        if took is not None and took > pred * (1 + margin):
            why.append(f"rank {r}: the index took {took:.2f} GiB of its GPU > the ledger's {pred:.2f}")
    return {"ok": not why, "why": why}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="perf/nodecheck.py", description=__doc__.split("\n")[0],
                                     epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/node_check.json", help="the JSON (rank 0 writes it)")
    parser.add_argument("--tiny", action="store_true", help="CPU ranks (gloo), small sizes")
    parser.add_argument("--layers", type=int, default=4,
                        help="decoder layers of the Qwen2.5-3B-wide ZeRO-2 model")
    parser.add_argument("--index_rows", type=int, default=0,
                        help="random vectors of the index (default: 4,000,000; --tiny 20,000)")
    parser.add_argument("--queries", type=int, default=512, help="queries searched")
    parser.add_argument("--margin", type=float, default=0.1,
                        help="how far a measured figure may be from its prediction")
    args = parser.parse_args(argv)
    args.index_rows = args.index_rows or (20_000 if args.tiny else 4_000_000)
    if "RANK" not in os.environ:
        parser.error("run it under torchrun: torchrun --nproc_per_node N -m perf.nodecheck ...")
    result = check(args)
    result.update(verdict(result, args.margin))
    if int(os.environ["RANK"]) == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps({k: result[k] for k in ("world", "device", "ok", "why")}), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
