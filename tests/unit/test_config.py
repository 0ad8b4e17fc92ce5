"""Configuration loads defaults, TOML, KVSTORE_* and overrides in that order, and names bad settings."""

import pytest

from kvstore import config
from kvstore.config import ConfigError


def test_defaults_are_valid():
    cfg = config.load(environ={})
    assert cfg.dram.arena_bytes == 1 << 30
    assert cfg.allowed_uids  # the server's own uid by default


def test_precedence_file_then_env_then_overrides(tmp_path):
    path = tmp_path / "kvstore.toml"
    path.write_text('[dram]\narena_bytes = "2GiB"\n[leases]\nread_ttl_ms = 111\nwrite_ttl_ms = 222\n')
    cfg = config.load(str(path), environ={"KVSTORE_LEASES_READ_TTL_MS": "333"},
                      overrides=["leases.write_ttl_ms=444"])
    assert cfg.dram.arena_bytes == 2 << 30
    assert cfg.leases.read_ttl_ms == 333
    assert cfg.leases.write_ttl_ms == 444


@pytest.mark.parametrize("kwargs, dotted", [
    ({"overrides": ["dram.arena_size=1"]}, "dram.arena_size"),
    ({"overrides": ["nope.x=1"]}, "nope.x"),
    ({"environ": {"KVSTORE_SHM_ALLOWED_UID": "1"}}, "shm.allowed_uid"),
    ({"overrides": ["dram.arena_bytes=lots"]}, "dram.arena_bytes"),
    ({"overrides": ["dram.hugepages=maybe"]}, "dram.hugepages"),
    ({"overrides": ["limits.page_bytes_max=1GiB"]}, "limits.page_bytes_max"),
    ({"overrides": ["leases.read_ttl_ms=0"]}, "leases.read_ttl_ms"),
    ({"overrides": ["dram.arena_bytes=1MiB"]}, "dram.arena_bytes"),
    ({"overrides": ["nvme.shards_per_path=0"]}, "nvme.shards_per_path"),
    ({"overrides": ["nvme.shards_per_path=65"]}, "nvme.shards_per_path"),
    ({"overrides": ["nvme.shards_per_path=4", "nvme.map_bytes=7MiB"]}, "nvme.map_bytes"),
    ({"overrides": ["nvme.shards_per_path=64", "nvme.paths=/a,/b,/c,/d,/e"]}, "nvme.paths"),
    ({"overrides": ["controller.writer_nice=20"]}, "controller.writer_nice"),
])
def test_bad_settings_name_their_dotted_path(kwargs, dotted):
    with pytest.raises(ConfigError, match=dotted.replace(".", r"\.")):
        config.load(environ=kwargs.get("environ", {}), overrides=kwargs.get("overrides"))


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[dram\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(str(bad), environ={})
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(str(tmp_path / "missing.toml"), environ={})
    nested = tmp_path / "nested.toml"
    nested.write_text("arena_bytes = 5\n")
    with pytest.raises(ConfigError, match="arena_bytes"):
        config.load(str(nested), environ={})


def test_sizes_and_lists_parse():
    cfg = config.load(environ={}, overrides=["dram.slab_bytes=8MiB", "shm.allowed_uids=1000,1001"])
    assert cfg.dram.slab_bytes == 8 << 20
    assert cfg.allowed_uids == frozenset({1000, 1001})


@pytest.mark.parametrize("text, nbytes", [("21.9GiB", 219 * (1 << 30) // 10), ("1.5GiB", 3 << 29), ("65536.3KiB", 67109171),
                                          ("67108864", 67108864)])
def test_a_size_with_a_fraction_reads_as_the_whole_bytes_it_names(text, nbytes):
    assert config.load(environ={}, overrides=[f"dram.arena_bytes={text}"]).dram.arena_bytes == nbytes


@pytest.mark.parametrize("text", ["1.5", "1.5B", "0.5"])
def test_a_fraction_of_a_byte_or_a_count_is_refused(text):
    with pytest.raises(ConfigError, match=r"dram\.arena_bytes: cannot read"):
        config.load(environ={}, overrides=[f"dram.arena_bytes={text}"])


@pytest.mark.parametrize("override, dotted", [
    ("tcp.address=localhost", "tcp.address"),
    ("tcp.write_buffer_low_bytes=64MiB", "tcp.write_buffer_low_bytes"),
    ("tcp.connections_max=0", "tcp.connections_max"),
    ("shm.spin_us=-1", "shm.spin_us"),
    ("shm.spin_us=20000", "shm.spin_us"),
    ("rdma.queue_pairs_max=0", "rdma.queue_pairs_max"),
])
def test_data_plane_settings_are_checked(override, dotted):
    with pytest.raises(config.ConfigError, match=dotted):
        config.load(environ={}, overrides=[override])


def test_data_plane_settings_load_from_every_source():
    cfg = config.load(environ={"KVSTORE_TCP_CONGESTION": "cubic"}, overrides=["tcp.address=0.0.0.0:7070"])
    assert cfg.tcp.congestion == "cubic" and cfg.tcp.address == "0.0.0.0:7070" and not cfg.rdma.enabled


def test_events_section_reads_lists_and_checks_they_line_up():
    cfg = config.load(environ={}, overrides=["events.engine_ids=e1, e2",
                                         "events.endpoints=tcp://10.0.0.1:5557,ipc:///tmp/e2"])
    assert cfg.events.engine_ids == ("e1", "e2")
    assert cfg.events.endpoints == ("tcp://10.0.0.1:5557", "ipc:///tmp/e2")
    with pytest.raises(ConfigError, match="events.endpoints: needs one endpoint per"):
        config.load(environ={}, overrides=["events.engine_ids=e1,e2", "events.endpoints=tcp://h:1"])
    with pytest.raises(ConfigError, match="events.endpoints: each must be a ZMQ"):
        config.load(environ={}, overrides=["events.engine_ids=e1", "events.endpoints=h:1"])
    with pytest.raises(ConfigError, match="events.engine_ids: must be distinct"):
        config.load(environ={}, overrides=["events.engine_ids=e1,e1", "events.endpoints=tcp://h:1,tcp://h:2"])


def test_route_weights_keep_their_order():
    with pytest.raises(ConfigError, match="route.weight_engine_gpu: must exceed route.weight_dram"):
        config.load(environ={}, overrides=["route.weight_dram=1.5"])
    with pytest.raises(ConfigError, match="route.weight_dram: must exceed route.weight_nvme"):
        config.load(environ={}, overrides=["route.weight_nvme=0.7"])


def test_a_uid_map_alone_is_refused_since_clients_start_on_grpc():
    with pytest.raises(ConfigError, match=r"auth\.local_uids: needs auth\.tokens_file or auth\.tls_client_ca"):
        config.load(environ={}, overrides=["auth.local_uids=0:ops:admin"])
    cfg = config.load(environ={}, overrides=["auth.local_uids=0:ops:admin", "auth.tokens_file=/etc/kvstore/tokens"])
    assert cfg.auth.enabled and cfg.auth.local_uids == ("0:ops:admin",)


def test_a_uid_mapped_twice_is_refused():
    with pytest.raises(ConfigError, match=r"auth\.local_uids: names a uid twice"):
        config.load(environ={}, overrides=["auth.local_uids=1001:alice,1001:ops:admin",
                                           "auth.tokens_file=/etc/kvstore/tokens"])


def test_an_environment_variable_that_is_no_setting_is_named():
    with pytest.raises(config.ConfigError, match="environment variable KVSTORE_ARENA_BYTES: arena.bytes: unknown"):
        config.load(environ={"KVSTORE_ARENA_BYTES": "4GiB"})


def test_events_out_is_off_by_default_local_only_and_read_from_its_env_vars():
    assert not config.load(environ={}).events_out.enabled
    cfg = config.load(environ={"KVSTORE_EVENTS_OUT_ENDPOINT": "ipc:///tmp/kv.pub",
                               "KVSTORE_EVENTS_OUT_REPLAY_BATCHES": "7"}, overrides=["events_out.enabled=true"])
    assert cfg.events_out.endpoint == "ipc:///tmp/kv.pub" and cfg.events_out.replay_batches == 7
    with pytest.raises(ConfigError, match=r"events_out\.endpoint: tcp://\*:5567 is not a loopback"):
        config.load(environ={}, overrides=["events_out.endpoint=tcp://*:5567"])
    remote = config.load(environ={}, overrides=["events_out.endpoint=tcp://*:5567", "events_out.allow_remote=true"])
    assert remote.events_out.endpoint == "tcp://*:5567"
    with pytest.raises(ConfigError, match=r"events_out\.replay_endpoint: must be a ZMQ"):
        config.load(environ={}, overrides=["events_out.replay_endpoint=127.0.0.1:5568"])
    with pytest.raises(ConfigError, match=r"events_out\.replay_batches: must be positive"):
        config.load(environ={}, overrides=["events_out.replay_batches=0"])
    with pytest.raises(ConfigError, match=r"events_out\.queue_pages_max: must be at least"):
        config.load(environ={}, overrides=["events_out.queue_pages_max=10", "events_out.batch_events_max=100"])
