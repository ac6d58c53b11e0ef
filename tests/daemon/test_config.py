"""kvd.daemon.config and kvd.units: layer precedence, unit parsing, peers, and validation errors."""
from __future__ import annotations

import dataclasses

import pytest

from kvd.daemon.config import Config, load_config, parse_peers
from kvd.units import format_size, parse_duration, parse_size


@pytest.fixture
def toml_file(tmp_path):
    def write(text: str, name: str = "kvd.toml") -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return write


# ---- units ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("512MiB", 512 * 1024**2), ("4GiB", 4 * 1024**3), ("64KiB", 65536), ("1048576", 1048576),
    ("1.5GiB", int(1.5 * 1024**3)), ("2gb", 2 * 1000**3), ("10k", 10_000), ("7 B", 7), (" 3 mib ", 3 * 1024**2),
    ("1TiB", 1024**4), (4096, 4096), (0, 0), (2.0, 2),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "12XB", "-1", "GiB", "1 2MiB", -5, True, "1e"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize("text, expected", [
    ("250ms", 0.25), ("2d", 172800.0), ("5m", 300.0), ("30s", 30.0), ("1h", 3600.0), ("2min", 120.0), ("100us", 1e-4),
    ("1.5", 1.5), ("0", 0.0), (10, 10.0), (0.5, 0.5),
])
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["", "soon", "5y", "-1s", "ms", -1, False])
def test_parse_duration_rejects(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_format_size():
    assert format_size(512) == "512B"
    assert format_size(1536) == "1.5KiB"
    assert format_size(4 * 1024**3) == "4.0GiB"
    assert format_size(3 * 1024**5) == "3072.0TiB"


# ---- defaults and layers ------------------------------------------------------------------------


def test_defaults_with_empty_env():
    cfg = load_config(cli={}, env={})
    assert cfg == dataclasses.replace(cfg)  # frozen, comparable
    assert cfg.pool_size == 1 << 30
    assert cfg.block_size == 64 << 10
    assert cfg.chunk_size == 4 << 20
    assert cfg.window == 8
    assert cfg.checksum == "xxh3_64"
    assert cfg.listen.startswith("tcp://127.0.0.1:")
    assert cfg.peers == {}
    assert cfg.default_ttl == 600.0
    assert cfg.pool_prefault is True
    assert cfg.node_id  # the host name


def test_none_in_cli_means_not_given():
    cfg = load_config(cli={"window": None, "pool_size": None}, env={"KVD_WINDOW": "3"})
    assert cfg.window == 3
    assert cfg.pool_size == 1 << 30


def test_precedence_cli_over_env_over_file_over_defaults(toml_file):
    path = toml_file(
        'node_id = "from-file"\n'
        'window = 2\n'
        'pool_size = "256MiB"\n'
        'lease_timeout = "45s"\n'
        'checksum = "crc32"\n'
    )
    env = {"KVD_WINDOW": "3", "KVD_POOL_SIZE": "512MiB", "KVD_NODE_ID": "from-env"}
    cli = {"window": 4, "node_id": None}
    cfg = load_config(cli=cli, env=env, config_file=path)
    assert cfg.window == 4                   # CLI beats env and file
    assert cfg.node_id == "from-env"         # env beats file (CLI gave None)
    assert cfg.pool_size == 512 * 1024**2    # env beats file
    assert cfg.lease_timeout == 45.0         # file beats defaults
    assert cfg.checksum == "crc32"
    assert cfg.transfer_timeout == 15.0      # default

    assert load_config(env={}, config_file=path).window == 2
    assert load_config(env={"KVD_WINDOW": "3"}, config_file=path).window == 3


def test_kvd_table_in_file(toml_file):
    path = toml_file('[kvd]\nnode_id = "tabled"\nblock_size = "128KiB"\nchunk_size = "1MiB"\n')
    cfg = load_config(env={}, config_file=path)
    assert cfg.node_id == "tabled"
    assert cfg.block_size == 128 * 1024
    assert cfg.chunk_size == 1 << 20


def test_config_file_from_env(toml_file):
    path = toml_file('node_id = "via-env-path"\n')
    assert load_config(env={"KVD_CONFIG": path}).node_id == "via-env-path"
    explicit = toml_file('node_id = "explicit"\n', name="other.toml")
    assert load_config(env={"KVD_CONFIG": path}, config_file=explicit).node_id == "explicit"


def test_empty_env_value_is_ignored():
    cfg = load_config(env={"KVD_WINDOW": "", "KVD_NODE_ID": ""})
    assert cfg.window == 8
    assert cfg.node_id


def test_sizes_and_durations_in_every_layer(toml_file):
    path = toml_file('pool_size = "4GiB"\ndefault_ttl = "5m"\n')
    cfg = load_config(env={"KVD_CONNECT_TIMEOUT": "250ms"}, cli={"chunk_size": "8MiB", "transfer_timeout": "2m"},
                      config_file=path)
    assert cfg.pool_size == 4 * 1024**3
    assert cfg.default_ttl == 300.0
    assert cfg.connect_timeout == 0.25
    assert cfg.chunk_size == 8 * 1024**2
    assert cfg.transfer_timeout == 120.0


def test_toml_native_types(toml_file):
    path = toml_file("pool_size = 67108864\nwindow = 16\npool_prefault = false\ndefault_ttl = 1.5\n")
    cfg = load_config(env={}, config_file=path)
    assert cfg.pool_size == 64 << 20
    assert cfg.window == 16
    assert cfg.pool_prefault is False
    assert cfg.default_ttl == 1.5


@pytest.mark.parametrize("text, expected", [("1", True), ("true", True), ("YES", True), ("on", True),
                                            ("0", False), ("false", False), ("No", False), ("off", False)])
def test_boolean_env_values(text, expected):
    assert load_config(env={"KVD_POOL_PREFAULT": text}).pool_prefault is expected


def test_bad_boolean_env_value():
    with pytest.raises(ValueError, match="pool_prefault"):
        load_config(env={"KVD_POOL_PREFAULT": "maybe"})


# ---- peers ------------------------------------------------------------------------------------------


def test_peers_from_cli_list():
    cfg = load_config(cli={"peers": ["B=tcp://10.0.0.2:7470", "C = tcp://10.0.0.3:7470"]}, env={})
    assert cfg.peers == {"B": "tcp://10.0.0.2:7470", "C": "tcp://10.0.0.3:7470"}


def test_peers_from_env_string():
    cfg = load_config(env={"KVD_PEERS": "B=tcp://h:1,C=tcp://h:2"})
    assert cfg.peers == {"B": "tcp://h:1", "C": "tcp://h:2"}


def test_peers_from_toml_table(toml_file):
    path = toml_file('[peers]\nB = "tcp://h:1"\nC = "tcp://h:2"\n')
    assert load_config(env={}, config_file=path).peers == {"B": "tcp://h:1", "C": "tcp://h:2"}
    path = toml_file('[kvd]\nnode_id = "A"\n[kvd.peers]\nB = "tcp://h:1"\n')
    cfg = load_config(env={}, config_file=path)
    assert cfg.node_id == "A" and cfg.peers == {"B": "tcp://h:1"}


def test_peers_layers_replace_not_merge(toml_file):
    path = toml_file('[peers]\nB = "tcp://h:1"\n')
    cfg = load_config(env={"KVD_PEERS": "C=tcp://h:2"}, config_file=path)
    assert cfg.peers == {"C": "tcp://h:2"}
    cfg = load_config(cli={"peers": ["D=tcp://h:3"]}, env={"KVD_PEERS": "C=tcp://h:2"}, config_file=path)
    assert cfg.peers == {"D": "tcp://h:3"}


def test_parse_peers():
    assert parse_peers("") == {}
    assert parse_peers("B=tcp://h:1, ,") == {"B": "tcp://h:1"}
    assert parse_peers([]) == {}
    with pytest.raises(ValueError, match="NAME=tcp://"):
        parse_peers(["tcp://h:1"])


@pytest.mark.parametrize("peers", ["B=http://h:1", "B=", "=tcp://h:1", "B=h:1"])
def test_bad_peer_endpoints(peers):
    with pytest.raises(ValueError, match="peer"):
        load_config(env={"KVD_PEERS": peers})


def test_peer_without_equals_sign():
    with pytest.raises(ValueError, match="NAME=tcp://HOST:PORT"):
        load_config(cli={"peers": ["B"]}, env={})


# ---- validation errors ---------------------------------------------------------------------------------


def test_unknown_keys_in_file(toml_file):
    path = toml_file('node_id = "x"\npool_sise = "1GiB"\nbogus = 1\n')
    with pytest.raises(ValueError, match="unknown option") as info:
        load_config(env={}, config_file=path)
    assert "bogus" in str(info.value) and "pool_sise" in str(info.value)
    assert path in str(info.value)


def test_unknown_keys_in_kvd_table(toml_file):
    path = toml_file('[kvd]\nwindw = 3\n')
    with pytest.raises(ValueError, match="windw"):
        load_config(env={}, config_file=path)


@pytest.mark.parametrize("listen", ["ipc:///tmp/x.sock", "127.0.0.1:7470", "udp://h:1", ""])
def test_bad_listen_endpoint(listen):
    with pytest.raises(ValueError, match="listen must be a tcp://HOST:PORT endpoint"):
        load_config(cli={"listen": listen}, env={})


@pytest.mark.parametrize("endpoint, problem", [
    ("tcp://127.0.0.1:99999", "port 99999 is out of range (1-65535)"),
    ("tcp://127.0.0.1:0", "port 0 is out of range (1-65535)"),
    ("tcp://127.0.0.1", "has no port"),
    ("tcp://127.0.0.1:", "has no port"),
    ("tcp://[::1]", "has no port"),
    ("tcp://:7470", "has no port"),
    ("tcp://h:74x", "the port must be a number 1-65535, got '74x'"),
])
def test_a_tcp_endpoint_needs_a_port_in_range(endpoint, problem):
    from kvd.wire.endpoints import tcp_endpoint_problem

    assert problem in tcp_endpoint_problem(endpoint)
    for cli in ({"listen": endpoint}, {"peers": {"B": endpoint}}, {"advertise": endpoint}, {"socket": endpoint}):
        with pytest.raises(ValueError, match=r"out of range|has no port|must be a number"):
            load_config(cli=cli, env={})


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:1", "tcp://[::1]:65535", "tcp://eth0:7470", "tcp://*:7470"])
def test_a_tcp_endpoint_in_range_passes(endpoint):
    from kvd.wire.endpoints import tcp_endpoint_problem

    assert tcp_endpoint_problem(endpoint) is None


@pytest.mark.parametrize("block", ["5000", "96KiB", "2048", "1"])
def test_block_size_must_be_a_power_of_two(block):
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        load_config(cli={"block_size": block}, env={})


@pytest.mark.parametrize("name, value", [("pool_size", "lots"), ("block_size", "64 KB B"), ("chunk_size", "4QiB")])
def test_bad_size_strings(name, value):
    with pytest.raises(ValueError, match="not a size") as info:
        load_config(cli={name: value}, env={})
    assert "MiB" in str(info.value)  # the message suggests a valid spelling


def test_bad_duration_string_from_file(toml_file):
    path = toml_file('lease_timeout = "forever"\n')
    with pytest.raises(ValueError, match="not a duration"):
        load_config(env={}, config_file=path)


@pytest.mark.parametrize("cli, message", [
    ({"chunk_size": "96KiB"}, "chunk_size must be a multiple of block_size"),
    ({"pool_size": "4KiB"}, "smaller than one block"),
    ({"window": 0}, "window must be at least 1"),
    ({"checksum": "md5"}, "checksum must be one of"),
    ({"log_format": "xml"}, "log_format"),
    ({"log_level": "loud"}, "log_level"),
    ({"device": "tpu"}, "device must be cpu or cuda"),
    ({"metrics_port": 70000}, "metrics_port"),
    ({"node_id": "n" * 129}, "node_id"),
    ({"socket": "/tmp/kvd.sock"}, "socket must be"),
])
def test_invalid_values(cli, message):
    with pytest.raises(ValueError, match=message):
        load_config(cli=cli, env={})


def test_several_problems_reported_together():
    with pytest.raises(ValueError) as info:
        load_config(cli={"window": 0, "checksum": "md5"}, env={})
    text = str(info.value)
    assert text.startswith("invalid configuration")
    assert "window" in text and "checksum" in text


def test_direct_config_validation_and_public():
    cfg = Config(node_id="A", socket="ipc:///tmp/a.sock", peers={"B": "tcp://h:1"})
    public = cfg.public()
    assert public["peers"] == {"B": "tcp://h:1"} and public["node_id"] == "A"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.window = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="negative"):
        Config(node_id="A", socket="ipc:///tmp/a.sock", default_ttl=-1)


@pytest.mark.parametrize("value, budget", [("0.5", 32 << 20), (0.25, 16 << 20), ("1", 64 << 20), ("0", 0),
                                           ("2MiB", 2 << 20), ("1048576B", 1 << 20), ("1", 64 << 20)])
def test_cache_size_is_a_fraction_or_a_size_with_its_unit(value, budget):
    assert load_config(cli={"cache_size": value, "pool_size": "64MiB"}, env={}).cache_budget == budget


@pytest.mark.parametrize("value", ["2", "1.5", 2, 1.5, "1e9", 2147483648])
def test_cache_size_a_bare_number_above_one_is_refused(value):
    with pytest.raises(ValueError, match=r"has no unit: a bare number is a fraction of the pool \(0-1"):
        load_config(cli={"cache_size": value}, env={})
