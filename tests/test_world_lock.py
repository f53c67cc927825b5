"""Tests for worlds/lock.py (content digests, worlds.lock) and for the committed worlds: both presets rebuilt at test
scale on pinned numerics, in fresh processes, give exactly the committed digests."""
import hashlib
import json
import os
import subprocess
import sys

import pytest

from worlds import lock as world_lock
from worlds.chains import SUITE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_world(folder, times=1.5, corpus="/a/corpus.jsonl", answer="Zorvak"):
    """A folder shaped like a built world: a data file, index/meta.json with absolute paths, world.json with timings."""
    os.makedirs(os.path.join(folder, "index"), exist_ok=True)
    with open(os.path.join(folder, "test.jsonl"), "w") as f:
        f.write(json.dumps({"question": "Where?", "golden_answers": [answer]}) + "\n")
    with open(os.path.join(folder, "index", "meta.json"), "w") as f:
        json.dump({"dim": 384, "corpus": corpus, "encoder_resolved": corpus + "/minilm", "n_rows": 2}, f)
    with open(os.path.join(folder, "world.json"), "w") as f:
        json.dump({"stats": {"preset": "tiny", "seed": 0, "scale": "test", "times": {"total_s": times}}}, f)
    return str(folder)


def test_digests_are_of_content_only(tmp_path):
    a = fake_world(tmp_path / "a")
    b = fake_world(tmp_path / "b", times=99.0, corpus="/elsewhere/corpus.jsonl")  # same world, other paths and times
    c = fake_world(tmp_path / "c", answer="Zorvik")  # another world
    da, db, dc = (world_lock.world_digests(x) for x in (a, b, c))
    assert sorted(da) == ["index/meta.json", "test.jsonl", "world.json"]
    assert da == db
    assert [rel for rel in da if da[rel] != dc[rel]] == ["test.jsonl"]
    with open(os.path.join(a, "test.jsonl"), "rb") as f:  # a plain file: the sha256 of its bytes
        assert da["test.jsonl"] == hashlib.sha256(f.read()).hexdigest()
    # a JSON file: canonical, less the non-content fields
    canonical = json.dumps({"dim": 384, "n_rows": 2}, sort_keys=True, separators=(",", ":")).encode()
    assert da["index/meta.json"] == hashlib.sha256(canonical).hexdigest()


def test_lock_round_trip_and_verdicts(tmp_path):
    lock = str(tmp_path / "worlds.lock")
    a = fake_world(tmp_path / "a")
    assert world_lock.compare(a, lock) == (("tiny", 0, "test"), None)  # no lock file: nothing to compare
    assert world_lock.write_entry(a, lock) == ("tiny", 0, "test")
    assert world_lock.read_lock(lock) == {("tiny", 0, "test"): world_lock.world_digests(a)}
    assert world_lock.verdict(a, lock)[0]
    b = fake_world(tmp_path / "b", times=7.0, answer="Zorvik")
    os.makedirs(os.path.join(b, "policy"))
    open(os.path.join(b, "policy", "extra.bin"), "wb").close()
    assert world_lock.compare(b, lock) == (("tiny", 0, "test"), ["policy/extra.bin", "test.jsonl"])
    ok, message = world_lock.verdict(b, lock)
    assert not ok and "2 file(s) differ" in message and "policy/extra.bin, test.jsonl" in message
    assert "different world" in message and "built before the pins" in message
    other = fake_world(tmp_path / "other")
    with open(os.path.join(other, "world.json"), "w") as f:
        json.dump({"stats": {"preset": "chains", "seed": 3, "scale": "full"}}, f)
    assert world_lock.verdict(other, lock) == (True, f"{other} (chains, seed 3, full scale): no entry in worlds.lock, "
                                                     "nothing to compare")
    world_lock.write_entry(other, lock)  # a second entry keeps the first
    assert set(world_lock.read_lock(lock)) == {("tiny", 0, "test"), ("chains", 3, "full")}


@pytest.mark.parametrize("line", ["tiny 0 test corpus.jsonl", "tiny x test a " + "0" * 64, "tiny 0 test a " + "0" * 63])
def test_a_bad_lock_line_is_named(tmp_path, line):
    lock = tmp_path / "worlds.lock"
    lock.write_text("# comment\n\n" + line + "\n")
    with pytest.raises(ValueError, match="worlds.lock, line 3: expected 'preset seed scale file sha256'"):
        world_lock.read_lock(str(lock))


def test_the_lock_holds_both_presets_at_both_scales():
    entries = world_lock.read_lock()
    for key in [("tiny", 0, "full"), ("tiny", 0, "test"), ("chains", 0, "full"), ("chains", 0, "test"),
                *((name, 0, "full") for name in SUITE), ("luck-high", 0, "test")]:
        assert sorted(entries[key]) == sorted(entries[("tiny", 0, "test")]), key  # the same 13 files in each
    assert len(entries[("tiny", 0, "test")]) == 13


def test_the_shipped_worlds_are_the_locked_ones():
    """worlds/<preset>-<seed> (what `make world` copies) holds exactly the files of its worlds.lock entry."""
    shipped = sorted(d for d in os.listdir(os.path.join(ROOT, "worlds"))  # the builds beside the builder
                     if os.path.isdir(os.path.join(ROOT, "worlds", d)) and not d.startswith("__"))
    assert shipped == sorted(["chains-0", "tiny-0", *(f"{name}-0" for name in SUITE)])
    for name in shipped:
        key, differing = world_lock.compare(os.path.join(ROOT, "worlds", name))
        assert f"{key[0]}-{key[1]}" == name and key[2] == "full" and differing == [], (name, differing)


def test_committed_worlds_rebuild_to_their_digests(tmp_path):
    """Both presets and a suite world at test scale, each built by `worlds/build.py` in a fresh process (pinned
    before torch loads), in an
    environment that asks for other kernels and threads: the pins override it, and every file matches worlds.lock."""
    env = {k: v for k, v in os.environ.items() if k != "ALLOW_UNPINNED"}  # a difference must fail the build
    env.update(OMP_NUM_THREADS="2", MKL_CBWR="AVX512", ATEN_CPU_CAPABILITY="avx512", ONEDNN_MAX_CPU_ISA="ALL")
    procs = {p: subprocess.Popen([sys.executable, "-m", "worlds.build", "--out", str(tmp_path / p), "--preset", p, "--scale",
                                  "test"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in ("tiny", "chains", "luck-high")}
    for preset, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert "every file matches worlds.lock" in out and "OMP_NUM_THREADS=2 replaced" in err
        assert world_lock.compare(str(tmp_path / preset)) == ((preset, 0, "test"), [])
        with open(tmp_path / preset / "world.json") as f:
            assert json.load(f)["stats"]["numerics"] == {"pinned": True, "cpu_capability": "AVX2", "threads": 1,
                                                          "mkl_branch": "COMPATIBLE", "faiss_simd": "AVX2"}


def test_cpucheck_names_every_digest_that_differs_between_cpus_or_from_the_lock():
    """perf/cpucheck.py's verdict: one line per file that two CPUs computed differently or that differs from
    worlds.lock, naming each CPU's digest; agreement with the lock on every CPU is no line at all."""
    from perf import cpucheck
    locked = {f"tiny/{k}": v[:12] for k, v in world_lock.read_lock()[("tiny", 0, "test")].items()}
    policy = "tiny/policy/model.safetensors"
    same = {cpu: dict(locked, **{"probe/policy": "abc"}) for cpu in ("native", "EPYC-Milan-v1")}
    assert cpucheck.compare(same) == []
    apart = {"native": dict(same["native"], **{"probe/policy": "def"}), "EPYC-Milan-v1": same["EPYC-Milan-v1"]}
    assert cpucheck.compare(apart) == ["probe/policy: native def, EPYC-Milan-v1 abc"]
    off = {cpu: dict(r, **{policy: "000000000000"}) for cpu, r in same.items()}
    assert cpucheck.compare(off) == [f"{policy}: native 000000000000, EPYC-Milan-v1 000000000000 "
                                     f"(worlds.lock {locked[policy]})"]
