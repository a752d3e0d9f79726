"""The crash test's driver: fork a writer, SIGKILL it at a random moment, check what survived, repeat.

Each store setup (tier layout x write policy) has its own directory and journal under the run's root and
takes its turn round-robin. A writer incarnation first checks the previous kill (see
:mod:`tierstore.crashtest.worker`); the driver compares what it found with the journal as of that kill
(:meth:`Journal.judge`), then kills it in one of three ways: after a random delay, in the middle of a
``flush()`` (write_back; the driver watches the journal for a thread inside flush), or while it is still
opening the store. When the run stops, one more check-only incarnation per setup checks the last kill.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from .journal import Journal
from .worker import WorkerSpec, fork_worker

HOST = {"kind": "host", "capacity": "256KiB", "pinned": False}


@dataclass(frozen=True)
class Setup:
    """A tier layout under test. ``required`` tiers never evict here, so they must hold every acknowledged
    key. ``on_pressure`` is the store's pressure policy; with ``flaky_remote`` the writer's remote tier
    refuses a share of its writes (so the drop policy really drops); with ``faults`` the writer's disk tier
    fails that share of its reads and removals (EIO), so write-downs and evictions meet errors. A flush that
    fails is a finding, except in a setup whose tiers fail on purpose."""

    tiers: Callable[[str], list[dict[str, Any]]]
    required: tuple[str, ...]
    on_pressure: str = "keep"
    flaky_remote: float = 0.0
    faults: float = 0.0
    #: writers put by reservation (``store.reserve`` -> fill -> commit): kills land between reserve and commit
    reserve: bool = False


SETUPS: dict[str, Setup] = {
    "host+disk": Setup(lambda d: [HOST, {"kind": "disk", "path": f"{d}/disk"}], ("disk",)),
    "host+disk+remote": Setup(lambda d: [HOST, {"kind": "disk", "path": f"{d}/disk"},
                                         {"kind": "remote", "url": f"file://{d}/remote"}], ("disk", "remote")),
    "disk+remote": Setup(lambda d: [{"kind": "disk", "path": f"{d}/disk", "capacity": "512KiB"},
                                    {"kind": "remote", "url": f"file://{d}/remote"}], ("remote",)),
    # the drop policy: a small disk over a remote that refuses 30% of writes, so full tiers drop dirty chunks
    "drop:disk+remote": Setup(lambda d: [{"kind": "disk", "path": f"{d}/disk", "capacity": "256KiB"},
                                         {"kind": "remote", "url": f"file://{d}/remote"}], ("remote",),
                              on_pressure="drop", flaky_remote=0.3),
    # a small disk that fails 20% of its reads and removals: write-downs and evictions meet read and delete
    # errors (a chunk that cannot be read or removed must stay, never be lost), under both pressure policies
    "faults:disk+remote": Setup(lambda d: [{"kind": "disk", "path": f"{d}/disk", "capacity": "256KiB"},
                                           {"kind": "remote", "url": f"file://{d}/remote"}], ("remote",),
                                faults=0.2),
    "faults-drop:disk+remote": Setup(lambda d: [{"kind": "disk", "path": f"{d}/disk", "capacity": "256KiB"},
                                                {"kind": "remote", "url": f"file://{d}/remote"}], ("remote",),
                                     on_pressure="drop", faults=0.2),
    # puts by reservation into a pooled host tier (write_back only: the path reserves there)
    "reserve:host+disk": Setup(lambda d: [{**HOST, "pool": True}, {"kind": "disk", "path": f"{d}/disk"}], ("disk",),
                               reserve=True),
}
POLICIES = ("write_back", "write_through")
#: the drop setup under write_back only: a write_through put is acknowledged when it returns, drops or not
COMBOS = tuple(f"{s}/{p}" for s in SETUPS for p in POLICIES
               if not ((SETUPS[s].flaky_remote or SETUPS[s].faults or SETUPS[s].reserve) and p == "write_through"))
#: seconds a writer may take to open the store and report before the run counts it as an error
OPEN_TIMEOUT = 120.0
#: the run stops after this many writer failures (a writer that cannot open its store fails every time)
MAX_ERRORS = 10


@dataclass
class ComboReport:
    """The figures of one setup under one write policy."""

    kills: int = 0
    kills_mid_flush: int = 0
    kills_at_open: int = 0
    checks: int = 0  #: times every key was checked (after each kill that let the writer report)
    acked_checked: int = 0  #: acknowledged keys checked, summed over checks
    lost: int = 0  #: acknowledged keys found lost, summed over checks (a key lost for good counts at every check)
    wrong: int = 0
    lost_keys: int = 0  #: distinct keys ever found lost
    wrong_keys: int = 0
    live_wrong: int = 0  #: gets in a running writer that returned other bytes than its last put
    puts: int = 0
    acked_puts: int = 0
    flush_failures: int = 0
    dropped: int = 0  #: puts a flush reported dropped by the drop policy (not acknowledged)
    torn_records: int = 0
    errors: list[str] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)  #: the first few, with where they were found


class _Combo:
    def __init__(self, name: str, root: str):
        self.name = name
        layout, self.policy = name.split("/")
        self.setup = SETUPS[layout]
        self.dir = os.path.join(root, name.replace("/", "."))
        os.makedirs(self.dir, exist_ok=True)
        self.tiers = self.setup.tiers(self.dir)
        self.journal = Journal(os.path.join(self.dir, "journal.jsonl"))
        self.observed = os.path.join(self.dir, "observed.json")
        self.log = os.path.join(self.dir, "writer.log")
        self.report = ComboReport()
        self.lost_keys: set[str] = set()
        self.wrong_keys: set[str] = set()


class CrashTest:
    """Run kills across ``combos`` (names from :data:`COMBOS`) in the empty or new directory ``root``.

    Forks writers, so call it from a process with no other threads (the ``tierstore crashtest`` CLI).
    """

    def __init__(self, root: str, combos: tuple[str, ...] = COMBOS, seed: int | None = None, keys: int = 48,
                 threads: int = 2, max_delay: float = 0.5, sabotage: str | None = None,
                 progress: Callable[[str], None] | None = None):
        unknown = set(combos) - set(COMBOS)
        if unknown:
            raise ValueError(f"unknown crash test config(s) {sorted(unknown)}; known: {', '.join(COMBOS)}")
        if os.path.isdir(root) and os.listdir(root):
            raise ValueError(f"crash test directory {root!r} is not empty (its journals would not match)")
        self.seed = random.randrange(1 << 31) if seed is None else seed
        self.rng = random.Random(self.seed)
        self.combos = [_Combo(c, root) for c in combos]
        self.root, self.keys, self.threads, self.max_delay, self.sabotage = root, keys, threads, max_delay, sabotage
        self.progress = progress or (lambda line: None)
        self.kills = 0
        self._pid: int | None = None  # the writer alive now

    def run(self, kills: int | None = None, seconds: float | None = None) -> dict[str, Any]:
        """Kill until ``kills`` kills or ``seconds`` have passed (whichever first), check the last kills,
        and return the report (see :meth:`report`)."""
        if kills is None and seconds is None:
            raise ValueError("give a number of kills, a duration, or both")
        if threading.active_count() > 1:
            raise RuntimeError("the crash test forks writers: run it in a process without other threads")
        start = last_progress = time.monotonic()
        interrupted = False
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            rounds = 0
            while (kills is None or self.kills < kills) and (seconds is None or time.monotonic() - start < seconds):
                if sum(len(c.report.errors) for c in self.combos) >= MAX_ERRORS:
                    break  # writers keep failing: the report says why
                self._round(self.combos[rounds % len(self.combos)])
                rounds += 1
                if time.monotonic() - last_progress >= 2.0:
                    last_progress = time.monotonic()
                    self.progress(self._progress_line(last_progress - start))
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop killing, still check and report what was done
            interrupted = True
        finally:
            signal.signal(signal.SIGTERM, previous)
            if self._pid is not None:  # never leave a writer behind
                self._reap(kill=True)
        for combo in self.combos:
            self._check_only(combo)
        result = self.report(time.monotonic() - start, interrupted)
        self.progress(self._progress_line(result["elapsed_s"]))
        return result

    # ------------------------------------------------------------------ one incarnation
    def _config(self, combo: _Combo) -> dict[str, Any]:
        """The setup's store config with knobs drawn anew for each incarnation, as db_crashtest does."""
        tiers = [dict(t) for t in combo.tiers]
        for t in tiers:
            if t["kind"] == "disk":
                t.update(codec=self.rng.choice(["none", "zstd"]), io_threads=self.rng.choice([1, 4]))
            elif t["kind"] == "remote":
                t.update(compression=self.rng.choice(["none", "zstd"]), max_in_flight=self.rng.choice([1, 8]))
        return {"tiers": tiers, "write_policy": combo.policy, "max_in_flight": self.rng.choice([1, 2, 8]),
                "on_pressure": combo.setup.on_pressure}

    def _fork(self, combo: _Combo, check_only: bool = False) -> None:
        combo.journal.refresh()
        combo.journal.new_incarnation()
        if os.path.exists(combo.observed):
            os.unlink(combo.observed)
        spec = WorkerSpec(config=self._config(combo), journal=combo.journal.path, observed=combo.observed,
                          keys=self.keys, threads=self.threads, seed=self.rng.randrange(1 << 31),
                          start_seq=combo.journal.last_seq + 1, flaky_remote=combo.setup.flaky_remote,
                          faults=combo.setup.faults, reserve=combo.setup.reserve, check_only=check_only,
                          switch_interval=self.rng.choice([None, 1e-6]), sabotage=self.sabotage)
        self._pid = fork_worker(spec, combo.log)

    def _reap(self, kill: bool) -> int:
        """Wait for the current writer (SIGKILLed first if ``kill``); its wait status."""
        assert self._pid is not None
        pid, self._pid = self._pid, None
        if kill:
            os.kill(pid, signal.SIGKILL)  # a zombie still takes the signal, so this cannot miss
        return os.waitpid(pid, 0)[1]

    def _round(self, combo: _Combo) -> None:
        self._fork(combo)
        mode = self.rng.choices(["delay", "flush", "open"], weights=[5, 4 if combo.policy == "write_back" else 0, 1])[0]
        if mode == "open":  # kill it while it opens the store (or, if it is quick, just after)
            time.sleep(self.rng.uniform(0, 0.3))
            if os.path.exists(combo.observed):
                mode = "delay"
                self._check(combo)
        elif not self._wait_ready(combo):
            return
        if mode == "flush":  # after a random delay, the next moment a thread is inside flush() (if one comes)
            time.sleep(self.rng.uniform(0, self.max_delay))
            self._until_inside_flush(combo, time.monotonic() + max(self.max_delay, 1.0))
            time.sleep(self.rng.uniform(0, 0.003))
        elif mode == "delay":
            time.sleep(self.rng.uniform(0, self.max_delay))
        status = self._reap(kill=True)
        combo.journal.refresh()
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            self._error(combo, f"writer exited before the kill ({_describe(status)})")
            return
        self.kills += 1
        combo.report.kills += 1
        combo.report.kills_at_open += mode == "open"
        combo.report.kills_mid_flush += bool(combo.journal.open_flushes)

    def _wait_ready(self, combo: _Combo) -> bool:
        """Wait for the writer's report of what survived, then judge it. ``False`` (and an error is
        recorded) if the writer died or hung first."""
        assert self._pid is not None
        deadline = time.monotonic() + OPEN_TIMEOUT
        while not os.path.exists(combo.observed):
            done, status = os.waitpid(self._pid, os.WNOHANG)
            if done:
                self._pid = None
                self._error(combo, f"writer exited before it reported ({_describe(status)})")
                return False
            if time.monotonic() > deadline:
                self._reap(kill=True)
                self._error(combo, f"writer did not open the store within {OPEN_TIMEOUT:.0f}s")
                return False
            time.sleep(0.002)
        self._check(combo)
        return True

    def _check(self, combo: _Combo) -> None:
        with open(combo.observed) as f:
            observed = json.load(f)
        verdict = combo.journal.judge(observed, list(combo.setup.required))
        r = combo.report
        r.checks += 1
        r.acked_checked += verdict.checked
        r.lost += verdict.lost
        r.wrong += verdict.wrong
        for failure in verdict.failures:
            for problem, keys in (("lost", combo.lost_keys), ("wrong", combo.wrong_keys)):
                if problem in failure["problem"]:
                    keys.add(failure["key"])
            if len(r.failures) < 20:
                r.failures.append({"after_kill": r.kills, **failure})
        r.lost_keys, r.wrong_keys = len(combo.lost_keys), len(combo.wrong_keys)

    def _until_inside_flush(self, combo: _Combo, deadline: float) -> None:
        while time.monotonic() < deadline:
            combo.journal.refresh()
            if combo.journal.open_flushes:
                return
            time.sleep(0.0005)

    def _check_only(self, combo: _Combo) -> None:
        self._fork(combo, check_only=True)
        if self._wait_ready(combo) and (status := self._reap(kill=False)) != 0:
            self._error(combo, f"check-only writer failed ({_describe(status)})")

    def _error(self, combo: _Combo, what: str) -> None:
        combo.journal.refresh()
        detail = combo.journal.errors[-1] if combo.journal.errors else _tail(combo.log)
        combo.report.errors.append(f"{what}: {detail}")

    # ------------------------------------------------------------------ reporting
    def report(self, elapsed: float, interrupted: bool = False) -> dict[str, Any]:
        """``{"kills", "elapsed_s", "seed", "root", "interrupted", "ok", "totals": {...}, "configs": {...}}``."""
        configs = {}
        for combo in self.combos:
            j, r = combo.journal, combo.report
            r.puts = sum(len(h) for h in j.puts.values())
            r.acked_puts = len(j.acked)
            r.flush_failures, r.torn_records, r.live_wrong = j.flush_failures, j.torn, len(j.live_wrong)
            r.dropped = j.dropped
            configs[combo.name] = asdict(r)
        counters = [k for k, v in asdict(ComboReport()).items() if isinstance(v, int)]
        totals = {k: sum(c[k] for c in configs.values()) for k in counters}
        totals["errors"] = sum(len(c["errors"]) for c in configs.values())
        # a failed flush where every tier works is a finding too: write-back lost track of a chunk
        totals["bad_flushes"] = sum(c.report.flush_failures for c in self.combos
                                    if not (c.setup.flaky_remote or c.setup.faults))
        ok = not any(totals[k] for k in ("lost", "wrong", "live_wrong", "errors", "bad_flushes"))
        return {"kills": self.kills, "elapsed_s": round(elapsed, 2), "seed": self.seed, "root": self.root,
                "interrupted": interrupted, "ok": ok, "totals": totals, "configs": configs}

    def _progress_line(self, elapsed: float) -> str:
        r = [c.report for c in self.combos]
        return (f"[{elapsed:6.1f}s] kills {self.kills}  acknowledged keys checked {sum(x.acked_checked for x in r)}  "
                f"lost {sum(x.lost for x in r)}  wrong {sum(x.wrong for x in r)}  "
                f"errors {sum(len(x.errors) for x in r)}")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def _tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-lines:]) or "no output"
    except OSError:
        return "no log"


#: (column title, report field) of the summary table
_COLUMNS = (("kills", "kills"), ("mid-flush", "kills_mid_flush"), ("at-open", "kills_at_open"), ("puts", "puts"),
            ("acked", "acked_puts"), ("keys checked", "acked_checked"), ("lost", "lost"), ("wrong", "wrong"),
            ("lost keys", "lost_keys"), ("wrong keys", "wrong_keys"),
            ("live-wrong", "live_wrong"), ("flush-failed", "flush_failures"), ("dropped", "dropped"),
            ("errors", "errors"))


def format_table(result: dict[str, Any]) -> str:
    """The report as a table: one row per setup and write policy, then the totals."""
    widths = [max(len(title), 7) for title, _ in _COLUMNS]
    lines = [f"{'config':<32}" + "".join(f" {t:>{w}}" for (t, _), w in zip(_COLUMNS, widths, strict=True))]
    for name, row in [*result["configs"].items(), ("total", result["totals"])]:
        cells = [len(v) if isinstance(v := row[column], list) else v for _, column in _COLUMNS]
        lines.append(f"{name:<32}" + "".join(f" {c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    return "\n".join(lines)
