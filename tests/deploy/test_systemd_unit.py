"""The systemd unit: systemd-analyze verify prints nothing, the security exposure stays under
the threshold, and the unit keeps what kvstore needs (notify + watchdog, a fixed user, pinned
memory, devices and shared memory left reachable) with a config file that loads."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from kvstore import config
from system_tools import require_tool

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "kvstore.service"
CONFIG = ROOT / "deploy" / "systemd" / "kvstore.toml"
# systemd-analyze security rates exposure 0.0 (locked down) to 10.0; --threshold is in tenths.
EXPOSURE_MAX_TENTHS = 25


def directives(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", text)
    assert match, text
    return int(match[1]) * (60 if match[2] == "min" else 1)


def analyze_as_installed(*args: str) -> subprocess.CompletedProcess:
    """systemd-analyze with the unit's ExecStart in place, as deploy/README.md installs it.

    verify checks that ExecStart exists: a private mount namespace (root's own, else one of a user
    namespace, which needs no privilege) puts a tmpfs on /opt holding /opt/kvstore/bin/kvstore-server,
    a link to this checkout's console script, so the shipped unit is checked as it is and the host's
    /opt is left alone.
    """
    analyze = require_tool("systemd-analyze")
    installed = Path(sys.executable).with_name("kvstore-server")
    assert installed.exists(), f"{installed} is not installed"
    program = directives(UNIT.read_text())["ExecStart"][0].split()[0]
    script = (f'mount -t tmpfs tmpfs /opt && mkdir -p {Path(program).parent} && ln -s "$0" {program} '
              f'&& exec "$@"')
    namespace = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--map-root-user", "--mount"]
    return subprocess.run([*namespace, "sh", "-c", script, str(installed), analyze, *args],
                          capture_output=True, text=True, timeout=60)


def test_unit_keeps_what_kvstore_needs():
    unit = directives(UNIT.read_text())
    one = {key: values[-1] for key, values in unit.items()}
    assert one["Type"] == "notify" and one["NotifyAccess"] == "main"
    assert 0 < seconds(one["WatchdogSec"])
    assert one["User"] == "kvstore" and "DynamicUser" not in unit
    assert one["LimitMEMLOCK"] == "infinity"
    for hides_devices_or_ipc in ("PrivateDevices", "PrivateUsers", "PrivateIPC", "MemoryDenyWriteExecute"):
        assert one.get(hides_devices_or_ipc, "no") == "no", hides_devices_or_ipc
    program = one["ExecStart"].split()[0]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[Path(program).name] == "kvstore.server:main"


def test_example_config_loads_and_fits_the_stop_timeout():
    unit = directives(UNIT.read_text())
    environ = dict(value.split("=", 1) for value in unit["Environment"])
    config_path = unit["ExecStart"][0].split("--config", 1)[1].split()[0]
    assert config_path == "/etc/kvstore/kvstore.toml" and "kvstore" in unit["ConfigurationDirectory"]
    settings = config.load(str(CONFIG), environ=environ)
    assert settings.shm.socket_path.startswith("/run/" + unit["RuntimeDirectory"][0] + "/")
    assert settings.server.drain_timeout_s < seconds(unit["TimeoutStopSec"][0])
    state = "/var/lib/" + unit["StateDirectory"][0] + "/"
    assert settings.nvme.paths and all(p.startswith(state) for p in settings.nvme.paths), \
        "ProtectSystem=strict leaves only the state directory writable"


def test_systemd_analyze_verify_of_the_shipped_unit_is_silent():
    result = analyze_as_installed("verify", "--man=no", str(UNIT))
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_verify_check_catches_a_broken_unit(tmp_path):
    broken = tmp_path / "kvstore.service"
    broken.write_text(UNIT.read_text().replace("Type=notify", "Type=notfy"))
    result = analyze_as_installed("verify", "--man=no", str(broken))
    assert "Failed to parse service type" in result.stderr


def test_verify_check_catches_a_missing_program(tmp_path):
    moved = tmp_path / "kvstore.service"
    moved.write_text(UNIT.read_text().replace("/opt/kvstore/bin/", "/opt/elsewhere/bin/"))
    result = analyze_as_installed("verify", "--man=no", str(moved))
    assert "is not executable" in result.stderr


def test_security_exposure_under_threshold(tmp_path):
    analyze = require_tool("systemd-analyze")
    result = analyze_as_installed("security", "--offline=true", f"--threshold={EXPOSURE_MAX_TENTHS}", str(UNIT))
    level = re.search(r"Overall exposure level for kvstore.service: (\d+\.\d)", result.stdout)
    assert level, result.stdout + result.stderr
    assert result.returncode == 0, f"exposure {level[1]} over {EXPOSURE_MAX_TENTHS / 10}"
    loose = tmp_path / "loose" / "kvstore.service"
    loose.parent.mkdir()
    loose.write_text("[Service]\nType=notify\nExecStart=/bin/true\n")
    assert subprocess.run([analyze, "security", "--offline=true", f"--threshold={EXPOSURE_MAX_TENTHS}", str(loose)],
                          capture_output=True, timeout=60).returncode != 0, "the threshold must reject a bare unit"


@pytest.mark.parametrize("path", ["deploy/systemd/kvstore.sysusers"])
def test_sysusers_creates_the_unit_user(path):
    fields = (ROOT / path).read_text().splitlines()[-1].split()
    assert fields[:2] == ["u", "kvstore"]


def test_exec_reload_rereads_the_token_file(start_server, tmp_path):
    """`systemctl reload kvstore` runs ExecReload with MAINPID set: the node rereads auth.tokens_file."""
    import shlex
    import time

    from identities import Tokens

    tokens = Tokens(tmp_path)
    server = start_server({"auth.tokens_file": str(tokens.path)})
    [reload] = directives(UNIT.read_text())["ExecReload"]
    done = subprocess.run(shlex.split(reload), env={"MAINPID": str(server.process.pid), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    deadline = time.monotonic() + 10
    while "token file reloaded" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "token file reloaded" in server.log()
