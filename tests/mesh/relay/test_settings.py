"""Tests of the relay's settings: ``--relay``, ``--no-relay`` and ``--relay-ports``, and the saved config."""

from __future__ import annotations

import json

import pytest

from mesh.cli.parser import build_parser, main
from mesh.control.token import new_token
from mesh.errors import MeshError
from mesh.node.config import MeshConfig, default_relay_ports, load_config, parse_relay_ports, save_config
from mesh.state import StatePaths
from mesh.wireguard.keys import generate_private_key, public_key


def _config(role: str = "coordinator", **changes) -> MeshConfig:
    return MeshConfig(
        role=role, mesh_id="m", name="a", interface="sp0", backend="userspace", cidr="198.51.100.0/28",
        address="198.51.100.1", public_key="k", endpoint="192.0.2.1:51820", listen_port=51820, mtu=1420,
        keepalive=25, coordinator_key="k", coordinator_endpoint="192.0.2.1:51820", coordinator_address="198.51.100.1",
        api_port=51820, **changes,
    )  # fmt: skip


def test_default_relay_ports_sit_above_the_listen_port() -> None:
    assert default_relay_ports(51820) == (51821, 52076)
    assert default_relay_ports(65279) == (65280, 65535)
    assert default_relay_ports(65535) == (65279, 65534)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("40000-40001", (40000, 40001)), ("1000-2000", (1000, 2000)), (" 6000 - 6100 ", (6000, 6100))],
)
def test_parse_relay_ports(text: str, expected: tuple[int, int]) -> None:
    assert parse_relay_ports(text, 51820) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("40000", "FIRST-LAST"),
        ("a-b", "FIRST-LAST"),
        ("-5-10", "FIRST-LAST"),
        ("40000-40000", "at least two"),
        ("0-10", "within 1-65535"),
        ("65000-70000", "within 1-65535"),
        ("51800-51900", "listen port 51820"),
    ],
)
def test_parse_relay_ports_refuses(text: str, fragment: str) -> None:
    with pytest.raises(MeshError, match=fragment):
        parse_relay_ports(text, 51820)


def test_config_round_trip_keeps_the_relay_settings(tmp_path) -> None:
    paths = StatePaths(tmp_path)
    config = _config(relay=True, relay_ports=(40000, 40009))
    save_config(paths, config)
    loaded = load_config(paths)
    assert loaded == config and loaded.relay_ports == (40000, 40009)
    assert loaded.relay_port_range == range(40000, 40010)


@pytest.mark.parametrize(("role", "relays"), [("coordinator", True), ("member", False)])
def test_settings_saved_before_relays_existed_still_load(tmp_path, role: str, relays: bool) -> None:
    paths = StatePaths(tmp_path)
    save_config(paths, _config(role=role))
    old = json.loads(paths.config.read_text())
    del old["relay"], old["relay_ports"]
    paths.config.write_text(json.dumps(old))
    loaded = load_config(paths)
    assert loaded.relay is relays and loaded.relay_ports == (51821, 52076)


def test_flags_parse() -> None:
    parser = build_parser()
    init = parser.parse_args(["init", "--endpoint", "192.0.2.1:51820"])
    assert init.no_relay is False and init.relay_ports is None
    init = parser.parse_args(["init", "--endpoint", "192.0.2.1:51820", "--relay-ports", "40000-40100"])
    assert init.relay_ports == "40000-40100"
    assert parser.parse_args(["init", "--endpoint", "192.0.2.1:51820", "--no-relay"]).no_relay is True
    join = parser.parse_args(["join", "-", "--relay", "--endpoint", "192.0.2.9:51820"])
    assert join.relay is True and join.relay_ports is None


def _token() -> str:
    return new_token(public_key(generate_private_key()), "192.0.2.1:51820", 60).encode()


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["join", "TOKEN", "--relay"], "--relay needs --endpoint"),
        (["join", "TOKEN", "--relay-ports", "40000-40100"], "no --relay"),
        (["join", "TOKEN", "--relay", "--endpoint", "192.0.2.9:51820", "--relay-ports", "9"], "FIRST-LAST"),
        (
            ["init", "--endpoint", "192.0.2.1:51820", "--no-relay", "--relay-ports", "40000-40100"],
            "--no-relay",
        ),
        (["init", "--endpoint", "192.0.2.1:51820", "--relay-ports", "51800-51900"], "listen port 51820"),
    ],
)
def test_bad_relay_flags_are_one_line_errors(capsys, tmp_path, argv: list[str], fragment: str) -> None:
    argv = [_token() if word == "TOKEN" else word for word in argv]
    assert main([*argv, "--state-dir", str(tmp_path / "home")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardpool: error: ") and fragment in lines[0], lines
    assert not (tmp_path / "home").exists()
