import json
import os

import pytest

import tierstore
from tierstore.config import ENV_CONFIG, PrefetchPolicy, WritePolicy, parse_config
from tierstore.errors import ConfigError
from tierstore.sizes import parse_size


@pytest.mark.parametrize("text,expected", [
    (4096, 4096), ("512MiB", 512 << 20), ("32GiB", 32 << 30), ("1.5 GB", 1_500_000_000),
    ("10KB", 10_000), ("7B", 7), ("3", 3), ("2TiB", 2 << 40),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-1", -5, "12 parsecs", "GiB", "", True, 1.5, None])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError):
        parse_size(bad, key="tiers[0].capacity")


def test_full_config(tmp_path):
    cfg = parse_config({
        "tiers": [{"kind": "device", "device": "cpu", "capacity": "8MiB"},
                  {"kind": "host", "capacity": "32MiB", "pinned": True},
                  {"kind": "disk", "path": str(tmp_path / "d"), "capacity": "1GiB"},
                  {"kind": "remote", "url": f"file://{tmp_path}/r", "compression": "zstd", "name": "shared"}],
        "write_policy": "write_through", "prefetch_policy": "transient", "max_in_flight": 4})
    assert [t.name for t in cfg.tiers] == ["device", "host", "disk", "shared"]
    assert cfg.tiers[1].options["capacity"] == 32 << 20
    assert cfg.write_policy is WritePolicy.WRITE_THROUGH
    assert cfg.prefetch_policy is PrefetchPolicy.TRANSIENT
    assert cfg.max_in_flight == 4


@pytest.mark.parametrize("config,names", [
    ({"tiers": [{"kind": "host"}], "colour": "red"}, "colour"),
    ({"tiers": []}, "tiers"),
    ({"tiers": [{"kind": "tape"}]}, "tiers[0].kind"),
    ({"tiers": [{"kind": "host", "capcity": 5}]}, "capcity"),
    ({"tiers": [{"kind": "host", "capacity": "lots"}]}, "tiers[0].capacity"),
    ({"tiers": [{"kind": "disk"}]}, "path"),
    ({"tiers": [{"kind": "remote", "url": "nosuch://bucket/x"}]}, "tiers[0].url"),
    ({"tiers": [{"kind": "host"}, {"kind": "host"}]}, "duplicate"),
    ({"tiers": [{"kind": "host"}], "write_policy": "write_sometimes"}, "write_policy"),
    ({"tiers": [{"kind": "host"}], "max_in_flight": 0}, "max_in_flight"),
    ({"tiers": [{"kind": "disk", "path": "/proc/version/x"}]}, "tiers[0].path"),
])
def test_bad_config_names_the_key(config, names, tmp_path):
    with pytest.raises(ConfigError, match=names.replace("[", r"\[").replace("]", r"\]")):
        tierstore.open(config)


def test_unwritable_path_writes_nothing(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.access(ro, os.W_OK):  # root ignores mode bits; use a path under a file instead
        target = tmp_path / "afile"
        target.write_text("x")
        path = target / "cache"
    else:
        path = ro / "cache"
    with pytest.raises(ConfigError):
        tierstore.open({"tiers": [{"kind": "host"}, {"kind": "disk", "path": str(path)}]})
    assert not (tmp_path / "afile" / "cache").exists()


def test_yaml_and_json_files_and_env(tmp_path, monkeypatch):
    yml = tmp_path / "store.yaml"
    yml.write_text("tiers:\n  - {kind: host, capacity: 16MiB}\nwrite_policy: write_through\n")
    with tierstore.open(str(yml)) as s:
        assert s.write_policy is WritePolicy.WRITE_THROUGH
        assert s.tiers[0].capacity == 16 << 20
    js = tmp_path / "store.json"
    js.write_text(json.dumps({"tiers": [{"kind": "host", "capacity": 1024}]}))
    monkeypatch.setenv(ENV_CONFIG, str(js))
    with tierstore.open() as s:
        assert s.tiers[0].capacity == 1024
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        tierstore.open(str(bad))


def test_default_config_is_host_and_disk(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_CONFIG, raising=False)
    from tierstore.config import default_config
    cfg = parse_config(default_config(str(tmp_path / "cache")))
    assert [t.kind for t in cfg.tiers] == ["host", "disk"]
    assert cfg.tiers[1].options["path"].startswith(str(tmp_path))
    assert all(t.options["capacity"] > 0 for t in cfg.tiers)


# ---------------------------------------------------------------------- probe rows 4.14-4.17
@pytest.mark.parametrize("tier,key", [
    ({"kind": "disk", "read_only": "false"}, "read_only"),  # a quoted YAML boolean is truthy
    ({"kind": "disk", "durable": "no"}, "durable"),
    ({"kind": "disk", "durable": 1}, "durable"),
    ({"kind": "host", "pinned": "yes"}, "pinned"),
    ({"kind": "host", "pool": "true"}, "pool"),
    ({"kind": "remote", "list_on_open": "false"}, "list_on_open"),
    ({"kind": "host", "capacity": "1000TiB"}, "capacity"),  # more than any host's RAM
    ({"kind": "host", "slot_size": 100}, "slot_size"),
    ({"kind": "host", "slot_size": 0}, "slot_size"),
    ({"kind": "host", "slot_size": "1000B"}, "slot_size"),
    ({"kind": "disk", "path": "/tmp/a\0b"}, "path"),
    ({"kind": "disk", "permissions": "world"}, "permissions"),
    ({"kind": "remote", "permissions": 0o777}, "permissions"),
    ({"kind": "disk", "instances": 0}, "instances"),
    ({"kind": "disk", "io_threads": True}, "io_threads"),
])
def test_bad_tier_option_is_a_config_error_naming_it(tmp_path, tier, key):
    defaults = {"disk": {"path": str(tmp_path / "d")}, "remote": {"url": str(tmp_path / "r")}}
    cfg = {"tiers": [{"kind": "host", "capacity": "1MiB"}, {**defaults.get(tier["kind"], {}), **tier,
                                                              "name": "second"}]}
    with pytest.raises(ConfigError, match=rf"tiers\[1\]\.{key}"):
        tierstore.open(cfg)
    assert not (tmp_path / "d").exists() and not (tmp_path / "r").exists()  # nothing built


def test_good_options_are_normalised(tmp_path):
    cfg = parse_config({"tiers": [
        {"kind": "host", "capacity": "1MiB", "pinned": False, "pool": None, "slot_size": "4KiB"},
        {"kind": "disk", "path": str(tmp_path / "x" / ".." / "d"), "durable": True, "read_only": False,
         "permissions": "group", "instances": 3, "capacity": "2GB"}]})
    assert cfg.tiers[0].options["slot_size"] == 4096
    assert cfg.tiers[1].options["path"] == str(tmp_path / "d")
    assert cfg.tiers[1].options["capacity"] == 2_000_000_000


def test_backends_built_directly_are_checked_the_same_way(tmp_path):
    from tierstore.backends.file import FileBackend
    from tierstore.backends.fsspec import FsspecBackend
    from tierstore.backends.memory import HostBackend

    with pytest.raises(ConfigError, match="read_only"):
        FileBackend(path=tmp_path / "d", read_only="false")
    with pytest.raises(ConfigError, match="path"):
        FileBackend(path=str(tmp_path) + "/a\0b")
    with pytest.raises(ConfigError, match="list_on_open"):
        FsspecBackend(url=str(tmp_path / "r"), list_on_open="no")
    with pytest.raises(ConfigError, match="slot_size"):
        HostBackend(capacity=1 << 20, slot_size=100)
    assert not (tmp_path / "d").exists()


def test_disk_capacity_above_free_space_is_allowed(tmp_path):
    # the tier adopts what the filesystem really holds on ENOSPC (documented), so this is not an error
    with tierstore.open({"tiers": [{"kind": "disk", "path": str(tmp_path / "d"), "capacity": 1 << 62}]}) as store:
        assert store.tier("disk").capacity == 1 << 62


# ------------------------------------------------------------------ issue 38: edges that were accepted silently
@pytest.mark.parametrize("tier", [{"kind": "host", "capacity": 0}, {"kind": "host", "capacity": "0MiB"},
                                  {"kind": "device", "device": "cpu", "capacity": 0}])
def test_capacity_zero_is_a_config_error(tier):
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity: a capacity of 0 holds nothing"):
        parse_config({"tiers": [tier]})


def test_disk_capacity_zero_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity"):
        parse_config({"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity": 0}]})


def test_an_inverted_tier_order_is_a_config_error(tmp_path):
    disk = {"kind": "disk", "path": str(tmp_path / "d")}
    with pytest.raises(ConfigError, match=r"tiers\[1\]: a host tier below the disk tier tiers\[0\]"):
        parse_config({"tiers": [disk, {"kind": "host", "capacity": "1MiB"}]})
    with pytest.raises(ConfigError, match=r"tiers\[1\]: a disk tier below the remote tier"):
        parse_config({"tiers": [{"kind": "remote", "url": "memory://x"}, disk]})
    # a device tier on the CPU is host memory: it may sit beside host tiers (tests use it as a second one)
    parse_config({"tiers": [{"kind": "host", "capacity": "1MiB"}, {"kind": "device", "device": "cpu"}, disk]})


@pytest.mark.parametrize("device", ["bogus", "cuda:99", 7])
def test_a_device_that_does_not_exist_is_a_config_error(device):
    if device == "cuda:99" and not __import__("torch").cuda.is_available():
        device = "cuda"  # without CUDA any cuda device is unavailable
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.device"):
        parse_config({"tiers": [{"kind": "device", "device": device}]})


@pytest.mark.parametrize(("options", "match"), [
    ({"endpoint_ur": "http://127.0.0.1:9000"}, r"storage_options\.endpoint_ur: not an option of s3:// "
                                               r"\(S3FileSystem\) \(did you mean 'endpoint_url'\?\)"),
    ({"endpoint_url": "..."}, r"storage_options\.endpoint_url: expected http\(s\)://host"),
    ({"anno": True}, r"storage_options\.anno"),
])
def test_a_misspelt_or_placeholder_storage_option_is_a_config_error(options, match):
    with pytest.raises(ConfigError, match=match):
        parse_config({"tiers": [{"kind": "remote", "url": "s3://bucket/kv", "storage_options": options}]})


def test_storage_options_the_filesystem_takes_are_accepted():
    for url, options in [("s3://bucket/kv", {"endpoint_url": "http://127.0.0.1:9000", "key": "k", "secret": "s",
                                             "anon": False, "profile": "p", "config_kwargs": {},
                                             "use_listings_cache": False}),
                         ("memory://kv", {"skip_instance_cache": True}), ("file:///tmp/kv", {"auto_mkdir": True})]:
        parse_config({"tiers": [{"kind": "remote", "url": url, "storage_options": options}]})
    with pytest.raises(ConfigError, match=r"storage_options\.endpoint_url: not an option of memory://"):
        parse_config({"tiers": [{"kind": "remote", "url": "memory://kv",
                                 "storage_options": {"endpoint_url": "http://x"}}]})


def test_host_ram_check_speaks_in_human_units():
    with pytest.raises(ConfigError, match=r"capacity: 1024\.0 TiB is more than this host's [\d.]+ GiB of RAM"):
        parse_config({"tiers": [{"kind": "host", "capacity": 1 << 50}]})
