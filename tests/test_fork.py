"""A process that forks with stores open (engines fork their workers): in the child every call on an
inherited store raises ForkedError at once — no hang on thread pools that did not survive the fork, no
write acknowledged that nobody will flush — ``close()`` and the interpreter's exit return at once, and a
store opened in the child works. The parent's store is untouched (reliability probe 5.2-5.4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tierstore

_SCRIPT = r"""
import json, os, sys, threading, time
import tierstore
from tierstore.testing.data import chunk, key_of

work = sys.argv[1]
store = tierstore.open({"tiers": [{"kind": "disk", "path": work + "/disk", "capacity": "64MiB"}]})
keys = [key_of(i) for i in range(32)]
assert all(store.put_many([(k, chunk(i)) for i, k in enumerate(keys)]))
store.flush()
busy = threading.Event()
stop = threading.Event()

def reader():  # a parent thread inside the store (holding its locks) at the moment of the fork
    while not stop.is_set():
        store.get_many(keys)
        busy.set()

t = threading.Thread(target=reader)
t.start()
busy.wait()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    seen = {}
    for name, call in [("get_many", lambda: store.get_many(keys)), ("put", lambda: store.put(key_of(99), chunk(99))),
                       ("flush", lambda: store.flush()), ("contains_many", lambda: store.contains_many(keys)),
                       ("stats", lambda: store.stats())]:
        t0 = time.monotonic()
        try:
            call()
            seen[name] = "returned"
        except tierstore.ForkedError as exc:
            seen[name] = "ForkedError"
        seen[name + "_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    store.close()
    seen["close_s"] = time.monotonic() - t0
    own = tierstore.open({"tiers": [{"kind": "disk", "path": work + "/child", "capacity": "16MiB"}]})
    seen["own_put"] = own.put(key_of(7), chunk(7))
    own.flush()
    seen["own_get"] = bool(own.get(key_of(7))["k"].equal(chunk(7)["k"]))
    own.close()
    os.write(w, json.dumps(seen).encode())
    os.close(w)
    sys.exit(0)  # through the interpreter's exit (and its close of open stores)
os.close(w)
t0 = time.monotonic()
_, status = os.waitpid(pid, 0)
child_exit_s = time.monotonic() - t0
seen = json.loads(os.read(r, 65536) or b"{}")
stop.set()
t.join()
got = store.get_many(keys)
intact = all(g is not None and g["k"].equal(chunk(i)["k"]) for i, g in enumerate(got))
store.close()
print(json.dumps({"child": seen, "child_status": status, "child_exit_s": child_exit_s, "parent_intact": intact}))
"""


def test_a_forked_child_gets_a_clear_error_and_the_parent_keeps_its_store(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(tierstore.__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    child = out["child"]
    for name in ("get_many", "put", "flush", "contains_many", "stats"):
        assert child[name] == "ForkedError", child
        assert child[name + "_s"] < 1.0, child
    assert child["close_s"] < 1.0 and child["own_put"] and child["own_get"], child
    assert out["child_status"] == 0 and out["child_exit_s"] < 5.0, out
    assert out["parent_intact"], out


def test_a_forked_error_is_a_closed_error():
    err = tierstore.ForkedError("x")
    assert isinstance(err, tierstore.ClosedError)  # code that handles a closed store handles this too
