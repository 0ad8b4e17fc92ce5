"""The node SIGKILLed at every named failpoint (and at random points) under a write/read/delete
workload never serves a wrong byte, never serves a chain that is not a prefix, and never loses
a page that was on NVMe, with its whole chain, before the kill.

Each cycle: start a node armed at one point (name=kill@N), at several (name=kill%P) or not at
all (SIGKILL after a delay); run crash_workload.py against it until it dies; read the NVMe
shards of the dead node from disk; restart it (sometimes killed first at recovery.after_scan,
then again) and check it against the disk and the workload's journal (crash_checks.py).

    CRASH_KILLS=1000   run cycles until this many kills (default: every point once, a few random)
    CRASH_SEED=7       the plan, the workloads and the armed points follow from it
    CRASH_JSON=path    write the report there
(Not KVSTORE_*: the node reads every KVSTORE_* variable as a setting and refuses unknown ones.)
`make crash` runs the long form and prints the table.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from crash_checks import CheckResult, Model, check_restarted, read_shards
from kvstore.failpoints import NAMES
from kvstore_client import KVStoreClient, KVStoreError

WORKLOAD = Path(__file__).with_name("crash_workload.py")
STARTUP_POINT = "recovery.after_scan"
# Points this workload does not reach, armed by their own tests: its chains (at most 12 pages of 64 KiB) are
# below the size of a move the node shares (tests/fault/test_shared_buffer_crash.py).
ARMED_ELSEWHERE = ("move.before_copy",)
RUNTIME_POINTS = tuple(name for name in NAMES if name != STARTUP_POINT and name not in ARMED_ELSEWHERE)
POINT_WAIT_S = 8.0         # a point not reached by then is recorded as such and the node killed by hand
STARTUP_WAIT_S = 30.0
CHAINS_CHECKED_MAX = 90    # chains looked up and read after each restart
KNOWN_CHAINS = 60          # older chains each workload reads, extends and deletes
RANDOM_LABEL, SIGKILL_LABEL = "kill%P at several points", "SIGKILL after a delay"


@dataclasses.dataclass(frozen=True)
class Plan:
    label: str             # the report's row: a failpoint name, RANDOM_LABEL or SIGKILL_LABEL
    spec: str              # testing.failpoints of the node; "" for a plain SIGKILL
    wait_s: float          # how long the node may run (for SIGKILL_LABEL: when it is killed)
    policy: str            # controller.write_policy
    startup_kill: bool     # the first restart is armed at recovery.after_scan


def default_plans(rng: random.Random) -> list[Plan]:
    """Every point killed once (two restarts killed in recovery), a few random kills."""
    plans = [_sigkill(rng, 0)]  # puts pages on disk for the promotion points to find
    plans += [_at_point(rng, name, len(plans) + i, startup_kill=i in (2, 6)) for i, name in enumerate(RUNTIME_POINTS)]
    plans += [_random(rng, len(plans)), _random(rng, len(plans) + 1), _sigkill(rng, len(plans) + 2)]
    return plans


def long_plans(rng: random.Random) -> Iterator[Plan]:
    for index in itertools.count():
        kind = rng.random()
        if kind < 0.6:
            yield _at_point(rng, RUNTIME_POINTS[index % len(RUNTIME_POINTS)], index, rng.random() < 0.1, n_max=12)
        elif kind < 0.8:
            yield _random(rng, index)
        else:
            yield _sigkill(rng, index)


def _policy(index: int) -> str:
    return ("write_through", "write_back")[index % 2]


def _at_point(rng: random.Random, name: str, index: int, startup_kill: bool, n_max: int = 4) -> Plan:
    return Plan(name, f"{name}=kill@{rng.randint(1, n_max)}", POINT_WAIT_S, _policy(index), startup_kill)


def _random(rng: random.Random, index: int) -> Plan:
    names = rng.sample(RUNTIME_POINTS, 3)
    spec = ",".join(f"{name}=kill%{rng.choice((0.01, 0.05, 0.2))}" for name in names)
    return Plan(RANDOM_LABEL, spec, POINT_WAIT_S, _policy(index), rng.random() < 0.1)


def _sigkill(rng: random.Random, index: int) -> Plan:
    return Plan(SIGKILL_LABEL, "", rng.uniform(0.3, 2.0), _policy(index), False)


@dataclasses.dataclass
class Report:
    seed: int
    kills_asked: int                       # CRASH_KILLS; 0 for the default plan
    kills: int = 0
    kills_by_hand: int = 0                 # points not reached in time, and plain SIGKILLs
    points: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # label -> armed/reached
    cycles: int = 0
    pages_checked: int = 0
    pages_verified_by_workload: int = 0
    reachable_pages_checked: int = 0
    chains_checked: int = 0
    wrong_bytes: list[str] = dataclasses.field(default_factory=list)
    prefix_violations: list[str] = dataclasses.field(default_factory=list)
    lost_pages: list[str] = dataclasses.field(default_factory=list)
    resurrected_pages: list[str] = dataclasses.field(default_factory=list)  # deleted, back after the restart
    unexpected_exits: list[str] = dataclasses.field(default_factory=list)
    workload_errors: list[str] = dataclasses.field(default_factory=list)    # the workload failed on a live node
    duration_s: float = 0.0

    def point(self, label: str, reached: bool) -> None:
        row = self.points.setdefault(label, {"armed": 0, "reached": 0})
        row["armed"] += 1
        row["reached"] += reached

    def add(self, result: CheckResult, where: str) -> None:
        self.pages_checked += result.pages_checked
        self.reachable_pages_checked += result.reachable_pages
        self.chains_checked += result.chains_checked
        for found, into in ((result.wrong, self.wrong_bytes), (result.prefix, self.prefix_violations),
                            (result.lost, self.lost_pages), (result.resurrected, self.resurrected_pages)):
            into += [f"{where}: {line}" for line in found]

    def table(self) -> str:
        lines = [f"{'kill point':34} {'armed':>6} {'reached':>8}"]
        for label in (*NAMES, RANDOM_LABEL, SIGKILL_LABEL):
            row = self.points.get(label, {"armed": 0, "reached": 0})
            lines.append(f"{label:34} {row['armed']:>6} {row['reached']:>8}")
        counts = [("kills", self.kills), ("  of them by hand (point not reached, or plain SIGKILL)", self.kills_by_hand),
                  ("cycles", self.cycles), ("pages checked after restarts", self.pages_checked),
                  ("pages verified by the workloads", self.pages_verified_by_workload),
                  ("reachable NVMe pages checked present", self.reachable_pages_checked),
                  ("chains checked (prefix and bytes)", self.chains_checked),
                  ("wrong bytes", len(self.wrong_bytes)), ("prefix violations", len(self.prefix_violations)),
                  ("lost pages", len(self.lost_pages)), ("resurrected deleted pages", len(self.resurrected_pages)),
                  ("unexpected exits", len(self.unexpected_exits)), ("workload errors", len(self.workload_errors)),
                  ("duration s", f"{self.duration_s:.1f}")]
        lines += [f"{name:54} {value:>8}" for name, value in counts]
        for name in ("wrong_bytes", "prefix_violations", "lost_pages", "resurrected_pages", "unexpected_exits",
                     "workload_errors"):
            lines += [f"{name}: {line}" for line in getattr(self, name)[:10]]
        return "\n".join(lines)


class Harness:
    """Runs cycles against one pair of NVMe shards that lives across every kill."""

    def __init__(self, start_server: Callable, root: Path, rng: random.Random, report: Report):
        self.start_server, self.root, self.rng, self.report = start_server, root, rng, report
        self.shards = [root / "nvme" / "s0", root / "nvme" / "s1"]
        self.model = Model()
        self.workloads = 0

    def settings(self, policy: str) -> dict[str, object]:
        # Two shards a path: kills land while write-down writes shards at once.
        return {"nvme.enabled": "true", "nvme.paths": ",".join(map(str, self.shards)), "nvme.shards_per_path": 2,
                "nvme.map_bytes": "32MiB",
                "dram.arena_bytes": "4MiB", "dram.slab_bytes": "256KiB", "limits.page_bytes_max": "64KiB",
                "controller.write_policy": policy, "controller.high_watermark": 0.5,
                # An HBM pool on a host memfd: every page read is copied in, so kills land during moves too.
                "hbm.pool_bytes": "1MiB", "testing.hbm_on_host": "true", "hbm.promote_hits": 1}

    def cycle(self, index: int, plan: Plan) -> None:
        seed = self.rng.randrange(1 << 31)
        where = f"cycle {index} [{plan.label}: {plan.spec or 'none'}, seed {seed}, {plan.policy}]"
        known = self.root / f"known{index}.json"
        known.write_text(json.dumps(self.model.known_for_workload(self.rng, KNOWN_CHAINS)))
        workload = self._spawn(known, seed)
        env = {"KVSTORE_TESTING_FAILPOINTS": plan.spec, "KVSTORE_TESTING_FAILPOINTS_SEED": str(seed)}
        try:
            server = self.start_server(self.settings(plan.policy), env)
        except RuntimeError as exc:
            workload[0].kill()
            raise AssertionError(f"{where}: the armed node did not start: {exc}") from None
        rc, by_hand = self._run_until_death(server, plan, workload, known, seed, index, where)
        server.kill()
        self.report.kills += 1
        self.report.kills_by_hand += by_hand
        # A plain SIGKILL is "reached" when it was this harness's, at the planned delay.
        self.report.point(plan.label, reached=by_hand if plan.label == SIGKILL_LABEL else not by_hand)
        if rc != -signal.SIGKILL:
            self.report.unexpected_exits.append(f"{where}: the node exited with {rc}:\n{server.log()[-3000:]}")
        snapshot = read_shards(self.shards)
        if plan.startup_kill:
            killed = self._start_killed_in_recovery(index, plan.policy, seed)
            self.report.kills += 1
            self.report.kills_by_hand += not killed
            self.report.point(STARTUP_POINT, reached=killed)
        try:
            server = self.start_server(self.settings(plan.policy), {"KVSTORE_TESTING_FAILPOINTS": ""})
        except RuntimeError as exc:
            raise AssertionError(f"{where}: the node did not restart after the kill: {exc}") from None
        try:
            with KVStoreClient(server.address, timeout_s=30) as client:
                result = check_restarted(client, self.model, snapshot, index, self.rng, CHAINS_CHECKED_MAX)
        except KVStoreError as exc:  # the restarted node failed under the checks: its log says why
            time.sleep(0.5)
            self.report.unexpected_exits.append(f"{where}: the restarted node failed during the checks ({exc}), "
                                                f"exit code {server.process.poll()}:\n{server.log()[-3000:]}")
            result = CheckResult()
        finally:
            server.kill()
        self.report.add(result, where)
        self.report.cycles += 1

    def _spawn(self, known: Path, seed: int) -> tuple[subprocess.Popen, Path]:
        """A workload process, started before the node so that its imports overlap the node's start-up."""
        self.workloads += 1
        journal = self.root / f"journal{self.workloads}.txt"
        first_chain = self.workloads * 100_000
        with open(self.root / f"workload{self.workloads}.err", "wb") as err:
            process = subprocess.Popen([sys.executable, str(WORKLOAD), str(journal), str(seed), str(first_chain),
                                        str(known)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err)
        return process, journal

    def _run_until_death(self, server, plan: Plan, first: tuple[subprocess.Popen, Path], known: Path, seed: int,
                         index: int, where: str) -> tuple[int, bool]:
        """Feed the node workloads until it dies or its time is up (then SIGKILL it); (exit code, by hand)."""
        workloads = [first]
        ended_live: list[int] = []     # workloads that ended while the node still ran
        first[0].stdin.write(f"{server.address}\n".encode())
        first[0].stdin.close()
        deadline = time.monotonic() + plan.wait_s
        while server.process.poll() is None and time.monotonic() < deadline:
            process = workloads[-1][0]
            if process.poll() is not None:
                time.sleep(0.3)
                if server.process.poll() is None:
                    ended_live.append(len(workloads) - 1)
                    if len(workloads) > 3:
                        break
                    workloads.append(self._spawn(known, seed + len(workloads)))
                    workloads[-1][0].stdin.write(f"{server.address}\n".encode())
                    workloads[-1][0].stdin.close()
            time.sleep(0.005)
        by_hand = server.process.poll() is None
        if by_hand:
            server.process.kill()
        rc = server.process.wait()
        for process, _ in workloads:
            process.kill()
            process.wait()
        for position, (_, journal) in enumerate(workloads):
            ended = self.model.read_journal(journal, index)
            if position in ended_live:
                self.report.workload_errors.append(f"{where}: {'; '.join(ended) or 'exited with no journaled error'}")
        self.report.pages_verified_by_workload = self.model.verified_pages
        self.report.wrong_bytes += [f"{where}: {line}" for line in self.model.wrong]
        self.model.wrong.clear()
        return rc, by_hand

    def _start_killed_in_recovery(self, index: int, policy: str, seed: int) -> bool:
        """Start a node armed at recovery.after_scan; True if it died there, before serving."""
        workdir = self.root / f"startup{index}"
        workdir.mkdir()
        ready = workdir / "ready.json"
        args = [sys.executable, "-m", "kvstore.server", "--grpc-address", "127.0.0.1:0",
                "--shm-socket", str(workdir / "kvstore.sock"), "--ready-file", str(ready)]
        for key, value in self.settings(policy).items():
            args += ["--set", f"{key}={value}"]
        env = {**os.environ, "KVSTORE_TESTING_FAILPOINTS": f"{STARTUP_POINT}=kill@1",
               "KVSTORE_TESTING_FAILPOINTS_SEED": str(seed)}
        with open(workdir / "server.log", "wb") as log:
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + STARTUP_WAIT_S
        while process.poll() is None and not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        killed = process.poll() == -signal.SIGKILL
        process.kill()
        process.wait()
        if not killed and process.returncode != -signal.SIGKILL:
            self.report.unexpected_exits.append(
                f"cycle {index}: the node armed at {STARTUP_POINT} exited with {process.returncode}")
        return killed


def test_kill_at_every_failpoint_then_restart(start_server, tmp_path):
    kills = int(os.environ.get("CRASH_KILLS", "0"))
    seed = int(os.environ.get("CRASH_SEED", "2026"))
    rng = random.Random(seed)
    report = Report(seed, kills)
    harness = Harness(start_server, tmp_path, rng, report)
    started = time.monotonic()
    plans = long_plans(rng) if kills else iter(default_plans(rng))
    try:
        for index, plan in enumerate(plans):
            harness.cycle(index, plan)
            if kills and index % 50 == 49:
                print(f"cycle {index + 1}: kills {report.kills}, pages checked {report.pages_checked}, failures "
                      f"{len(report.wrong_bytes) + len(report.prefix_violations) + len(report.lost_pages)}, "
                      f"{time.monotonic() - started:.0f} s", flush=True)
            if kills and report.kills >= kills:
                break
    finally:
        report.duration_s = time.monotonic() - started
        table = report.table()
        print(table)
        if os.environ.get("CRASH_JSON"):
            Path(os.environ["CRASH_JSON"]).write_text(json.dumps(dataclasses.asdict(report), indent=1))
    assert report.pages_checked > 0 and report.reachable_pages_checked > 0, f"no check ran:\n{table}"
    assert not report.wrong_bytes, f"wrong bytes served:\n{table}"
    assert not report.prefix_violations, f"a chain served that is not a prefix:\n{table}"
    assert not report.lost_pages, f"pages on NVMe before a kill lost after the restart:\n{table}"
    assert not report.resurrected_pages, f"pages whose Delete answered came back after the restart:\n{table}"
    assert not report.unexpected_exits, f"the node exited other than by a kill:\n{table}"
    unreached = [name for name in NAMES
                 if name not in ARMED_ELSEWHERE and not report.points.get(name, {}).get("reached")]
    assert not unreached, f"failpoints never reached: {unreached}\n{table}"
