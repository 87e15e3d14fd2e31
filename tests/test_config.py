"""chorus.config: every CHORUS_* variable is declared there once, bad values name the
variable, overrides nest and restore, and ``python -m chorus.config`` prints them all."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import chorus
from chorus import cli, config
from chorus.config import SETTINGS, ConfigError
from chorus.errors import InvalidArgumentError
from chorus.schedules.registry import ALGORITHMS
from chorus.selection import HIERARCHICAL, HIERARCHICAL_COLLECTIVES

PACKAGE = Path(chorus.__file__).parent
ROOT = PACKAGE.parent
NAME = re.compile(r"CHORUS_[A-Z0-9_]+")


def names_in(paths) -> dict[str, str]:
    """Every CHORUS_* name in the text of ``paths`` -> one place it appears.  Names ending
    in ``_`` are prefixes that code completes (``f"CHORUS_ALGO_{name}"``): skipped here,
    checked per collective below."""
    found = {}
    for path in paths:
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            for name in NAME.findall(line):
                if not name.endswith("_"):
                    found.setdefault(name, f"{path}:{number}")
    return found


def undeclared(paths) -> dict[str, str]:
    return {name: where for name, where in names_in(paths).items() if name not in SETTINGS}


def test_every_chorus_name_in_the_package_is_declared():
    assert undeclared(sorted(PACKAGE.rglob("*.py"))) == {}


def test_the_check_finds_an_undeclared_name(tmp_path):
    module = tmp_path / "reader.py"
    module.write_text('import os\n\nLIMIT = os.environ.get("CHORUS_NOT_DECLARED_ANYWHERE")\n'
                      'ALGO = os.environ.get(f"CHORUS_ALGO_{name}")  # a prefix: skipped\n')
    assert undeclared([module]) == {"CHORUS_NOT_DECLARED_ANYWHERE": f"{module}:3"}


def test_every_collective_has_its_algorithm_setting_naming_its_algorithms():
    for collective, family in ALGORITHMS.items():
        meaning = config.setting(f"CHORUS_ALGO_{collective.upper()}").meaning
        for name in family:
            assert re.search(rf"\b{name}\b", meaning), (collective, name)
        assert (HIERARCHICAL in meaning) == (collective in HIERARCHICAL_COLLECTIVES), collective
    declared = {name.removeprefix("CHORUS_ALGO_").lower() for name in SETTINGS if name.startswith("CHORUS_ALGO_")}
    assert declared == set(ALGORITHMS)


def test_every_declaration_is_complete():
    for name, setting in SETTINGS.items():
        assert setting.name == name and setting.meaning, name
        if setting.default is not None:
            assert setting.parse(config.format_value(setting.default)) == setting.default, name


# -- bad values ----------------------------------------------------------------------------

def bad_values(setting: config.Setting) -> list[str]:
    """Texts that ``setting`` must refuse."""
    if setting.kind == "int":
        bad = ["abc", "1.5", "12abc"]
    elif setting.kind == "float":
        bad = ["abc", "nan", "1,5"]
    elif setting.kind == "bool":
        bad = ["maybe", "2", "enabled"]
    elif setting.kind == "choice":
        bad = ["bogus", f"{setting.choices[0]},{setting.choices[-1]}"]
    elif setting.kind == "list":
        bad = ["a,,b", ",", "a,"]
    else:
        return []
    if setting.minimum is not None:
        bad.append(str(setting.minimum - 1))
    if setting.maximum is not None:
        bad.append(str(setting.maximum + 1))
    return bad


CHECKED = [s for s in SETTINGS.values() if bad_values(s)]


@pytest.mark.parametrize("setting", CHECKED, ids=[s.name for s in CHECKED])
def test_a_bad_value_raises_an_error_naming_the_variable(setting, monkeypatch):
    for text in bad_values(setting):
        monkeypatch.setenv(setting.name, text)
        with pytest.raises(ConfigError) as info:
            config.get(setting.name)
        message = str(info.value)
        assert message.startswith(f"{setting.name}={text!r}: give "), message
        assert setting.describe_default() in message
        with pytest.raises(ConfigError, match=setting.name):
            config.snapshot()
        monkeypatch.delenv(setting.name)
        with pytest.raises(ConfigError, match=setting.name), config.override(**{setting.name: text}):
            pass


def test_every_setting_of_a_checked_kind_has_bad_values():
    assert {s.name for s in CHECKED} == {s.name for s in SETTINGS.values() if s.kind != "str"}


def test_the_message_says_the_range_and_the_default(monkeypatch):
    monkeypatch.setenv("CHORUS_SHM_ONESHOT_BYTES", "abc")
    with pytest.raises(ConfigError) as info:
        config.get("CHORUS_SHM_ONESHOT_BYTES")
    assert str(info.value) == ("CHORUS_SHM_ONESHOT_BYTES='abc': give a whole number of bytes "
                               "from 0 to 1073741824 (default 65536)")
    assert isinstance(info.value, InvalidArgumentError) and isinstance(info.value, ValueError)
    monkeypatch.setenv("CHORUS_TRANSPORT", "udp")
    with pytest.raises(ConfigError, match=r"CHORUS_TRANSPORT='udp': give one of auto, shm, tcp \(default auto\)"):
        config.get("CHORUS_TRANSPORT")
    monkeypatch.setenv("CHORUS_HEARTBEAT_TIMEOUT", "0.5")
    with pytest.raises(ConfigError, match=r"a number of seconds >= 1 \(default 20\)"):
        config.get("CHORUS_HEARTBEAT_TIMEOUT")


def test_an_undeclared_name_is_refused():
    for call in (config.get, config.is_set, lambda name: config.override(**{name: 1}).__enter__()):
        with pytest.raises(config.UnknownSettingError, match="'CHORUS_NO_SUCH' is not a chorus setting") as info:
            call("CHORUS_NO_SUCH")
        assert isinstance(info.value, KeyError) and isinstance(info.value, ConfigError)


# -- good values ---------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "text", "value"), [
    ("CHORUS_SHM_ONESHOT_BYTES", " 1024 ", 1024),
    ("CHORUS_SHM_ONESHOT_BYTES", "0", 0),
    ("CHORUS_HEARTBEAT_TIMEOUT", "2", 2.0),
    ("CHORUS_HEARTBEAT_TIMEOUT", "2.5", 2.5),
    ("CHORUS_SHM_P2P", "off", False),
    ("CHORUS_SHM_P2P", "No", False),
    ("CHORUS_SHM_P2P", "0", False),
    ("CHORUS_SHM_P2P", "TRUE", True),
    ("CHORUS_SHM_CMA", "on", True),
    ("CHORUS_STORE_HOSTED", "1", True),
    ("CHORUS_TRANSPORT", " TCP ", "tcp"),
    ("CHORUS_HOST_ID", "a, a ,b", ("a", "a", "b")),
    ("CHORUS_HOST_ID", "solo", ("solo",)),
    ("CHORUS_TOKEN", " s3cret ", " s3cret "),  # a token is taken as given
    ("CHORUS_ALGO_ALL_REDUCE", "ring", "ring"),  # chorus.selection checks the name
    ("CHORUS_SHM_THREADS", "", None),  # empty: unset
    ("CHORUS_SHM_POLLS", "   ", 200),
])
def test_good_values(name, text, value, monkeypatch):
    monkeypatch.setenv(name, text)
    assert config.get(name) == value
    assert config.get(name, environ={name: text}) == value


def test_get_reads_the_environment_when_used_and_is_set_tells_unset_from_default(monkeypatch):
    monkeypatch.delenv("CHORUS_SHM_MAPPED_BYTES", raising=False)
    assert config.get("CHORUS_SHM_MAPPED_BYTES") == 1 << 20
    assert not config.is_set("CHORUS_SHM_MAPPED_BYTES")
    monkeypatch.setenv("CHORUS_SHM_MAPPED_BYTES", str(1 << 20))
    assert config.get("CHORUS_SHM_MAPPED_BYTES") == 1 << 20
    assert config.is_set("CHORUS_SHM_MAPPED_BYTES")
    monkeypatch.setenv("CHORUS_SHM_MAPPED_BYTES", "")
    assert not config.is_set("CHORUS_SHM_MAPPED_BYTES")
    assert config.get("CHORUS_JOB_ID", environ={}) is None
    assert config.is_set("CHORUS_JOB_ID", environ={"CHORUS_JOB_ID": "j"})


def test_snapshot_has_every_setting(monkeypatch):
    monkeypatch.setenv("CHORUS_SHM_POLLS", "7")
    values = config.snapshot()
    assert list(values) == list(SETTINGS)
    assert values["CHORUS_SHM_POLLS"] == 7
    assert config.snapshot(environ={})["CHORUS_SHM_POLLS"] == 200


# -- overrides -----------------------------------------------------------------------------

def test_override_nests_and_restores(monkeypatch):
    monkeypatch.setenv("CHORUS_SHM_ONESHOT_BYTES", "4096")
    with config.override(CHORUS_SHM_ONESHOT_BYTES=1024, CHORUS_SHM_P2P=False):
        assert config.get("CHORUS_SHM_ONESHOT_BYTES") == 1024
        assert config.get("CHORUS_SHM_P2P") is False
        with config.override(CHORUS_SHM_ONESHOT_BYTES="2048", CHORUS_TRANSPORT="TCP"):
            assert config.get("CHORUS_SHM_ONESHOT_BYTES") == 2048
            assert config.get("CHORUS_TRANSPORT") == "tcp"
        assert config.get("CHORUS_SHM_ONESHOT_BYTES") == 1024
        assert config.get("CHORUS_TRANSPORT") == "auto"
        with pytest.raises(RuntimeError), config.override(CHORUS_SHM_ONESHOT_BYTES=1):
            raise RuntimeError("the block fails")
        assert config.get("CHORUS_SHM_ONESHOT_BYTES") == 1024
    assert config.get("CHORUS_SHM_ONESHOT_BYTES") == 4096
    assert config.get("CHORUS_SHM_P2P") is True


def test_override_wins_over_the_environment_and_none_means_unset(monkeypatch):
    monkeypatch.setenv("CHORUS_TOKEN", "from-env")
    with config.override(CHORUS_TOKEN=None, CHORUS_HOST_ID=["a", "b"]):
        assert config.get("CHORUS_TOKEN") is None
        assert not config.is_set("CHORUS_TOKEN")
        assert config.get("CHORUS_TOKEN", environ={"CHORUS_TOKEN": "x"}) is None
        assert config.get("CHORUS_HOST_ID") == ("a", "b") and config.is_set("CHORUS_HOST_ID")
    assert config.get("CHORUS_TOKEN") == "from-env"


def test_a_refused_override_changes_nothing():
    with pytest.raises(ConfigError, match="CHORUS_SHM_POLLS"):
        with config.override(CHORUS_SHM_ONESHOT_BYTES=1024, CHORUS_SHM_POLLS=-1):
            pass
    with pytest.raises(ConfigError, match="CHORUS_SHM_THREADS='1.5'"):
        config.override(CHORUS_SHM_THREADS=1.5).__enter__()
    assert not config.is_set("CHORUS_SHM_ONESHOT_BYTES", environ={})


def test_an_override_is_seen_by_other_threads():
    seen = []
    with config.override(CHORUS_SHM_POLLS=3):
        worker = threading.Thread(target=lambda: seen.append(config.get("CHORUS_SHM_POLLS")))
        worker.start()
        worker.join()
    assert seen == [3]


# -- where settings are read -----------------------------------------------------------------

def test_converted_readers_use_the_settings(monkeypatch):
    from chorus import net, rendezvous
    from chorus.transport import shm_link, tcp

    with config.override(CHORUS_HEARTBEAT_TIMEOUT=3, CHORUS_SOCKET_HOST="10.1.2.3", CHORUS_TOKEN="tok",
                         CHORUS_SHM_P2P_BYTES=10000, CHORUS_SHM_P2P=False):
        assert tcp.heartbeat_timeout() == 3.0
        assert tcp.local_address_towards("example.org") == "10.1.2.3"
        assert net.get_token() == b"tok"
        assert shm_link.wanted_ring_bytes(2) == 8192
        assert not shm_link.enabled()
    assert rendezvous.detect_environment({"CHORUS_JOB_ID": "j", "RANK": "0"})["launcher"] == "chorusrun"
    assert rendezvous.detect_environment({"CHORUS_JOB_ID": "", "RANK": "0"})["launcher"] == "env"
    monkeypatch.setenv("CHORUS_HEARTBEAT_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="CHORUS_HEARTBEAT_TIMEOUT='soon'"):
        tcp.heartbeat_timeout()


def test_bench_transport_comes_from_the_setting(monkeypatch):
    from chorus.bench.cli import chosen_transport

    monkeypatch.setenv("CHORUS_TRANSPORT", "SHM")
    assert chosen_transport(None) == ("shm", None)
    assert chosen_transport("tcp") == ("tcp", None)
    monkeypatch.setenv("CHORUS_TRANSPORT", "udp")
    transport, problem = chosen_transport(None)
    assert transport == "" and problem.startswith("CHORUS_TRANSPORT='udp': give one of auto, shm, tcp")


# -- python -m chorus.config / chorus config ------------------------------------------------

def run_config(*args, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CHORUS_")}
    environ.update(env, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "chorus.config", *args], capture_output=True, text=True,
                          env=environ, timeout=60)


def test_python_m_chorus_config_prints_every_setting():
    result = run_config(CHORUS_SHM_POLLS="7", CHORUS_TOKEN="do-not-print")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:]}
    assert list(lines) == list(SETTINGS)
    assert lines["CHORUS_SHM_POLLS"][1:3] == ["7", "set"]
    assert lines["CHORUS_SHM_ONESHOT_BYTES"][1:3] == ["65536", "default"]
    assert "do-not-print" not in result.stdout


def test_python_m_chorus_config_json_and_bad_values():
    result = run_config("--json", CHORUS_TRANSPORT="udp")
    assert result.returncode == 1
    table = json.loads(result.stdout)
    assert list(table) == list(SETTINGS)
    assert table["CHORUS_SHM_P2P"] == {**table["CHORUS_SHM_P2P"], "value": True, "set": False, "default": True}
    assert table["CHORUS_TRANSPORT"]["error"].startswith("CHORUS_TRANSPORT='udp'")
    assert "CHORUS_TRANSPORT='udp'" in result.stderr


def test_chorus_config_subcommand(capsys, monkeypatch):
    monkeypatch.setenv("CHORUS_SHM_CMA", "off")
    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SETTINGS)
    assert re.search(r"^CHORUS_SHM_CMA\s+0\s+set\s", out, re.MULTILINE)
