"""examples/deploy stays deployable: the systemd units pass ``systemd-analyze verify``, the Kubernetes manifests
refer only to what they define (labels, volumes, ports, Services, the ConfigMap key the connector reads), and
every tierstore config in them is one tierstore accepts. The node server's examples (node-server/, the
DaemonSet and the engines using it) agree on the socket, its directory's mode and the paths they mount, and
their node config runs a real ``NodeServer`` here. The launch script itself runs real engines in
``make test-engines`` (tests/engines/test_vllm_deploy.py)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

import tierstore
from tierstore.config import parse_config
from tierstore.errors import ConfigError
from tierstore.serve import access
from tierstore.serve.server import DEFAULT_SOCKET, NodeServer, parse_serve
from tierstore.testing.data import assert_same, chunk, key_of

DEPLOY = Path(__file__).resolve().parents[1] / "examples" / "deploy"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"
NODE = DEPLOY / "node-server"


def test_the_launch_script_parses():
    subprocess.run(["bash", "-n", str(DEPLOY / "launch.sh")], check=True)


# ---------------------------------------------------------------- systemd

@pytest.fixture
def systemd_root(tmp_path):
    """A root for ``systemd-analyze verify --root``: the system's own units, our units, the binaries ours run."""
    if shutil.which("systemd-analyze") is None or not Path("/usr/lib/systemd/system").is_dir():
        pytest.skip("systemd-analyze is not installed")
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    for unit in [*SYSTEMD.glob("*.service"), *NODE.glob("*.service")]:
        shutil.copy(unit, units)
    bin_dir = root / "opt/vllm/bin"
    bin_dir.mkdir(parents=True)
    for name in ("vllm", "vllm-router", "tierstore"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    return root


def verify(root: Path, *units: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "verify", f"--root={root}", *units], capture_output=True, text=True,
                          cwd=root)


def test_the_systemd_units_verify_cleanly(systemd_root):
    r = verify(systemd_root, "tierstore-vllm@a.service", "tierstore-vllm@b.service", "vllm-router.service")
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def test_the_node_server_unit_verifies_cleanly(systemd_root):
    r = verify(systemd_root, "tierstore-serve.service")
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def test_the_verification_catches_a_bad_unit(systemd_root):
    unit = systemd_root / "etc/systemd/system/vllm-router.service"
    unit.write_text(unit.read_text().replace("Restart=on-failure", "Restart=on-failure\nRestartSecs=5"))
    r = verify(systemd_root, "vllm-router.service")
    assert "Unknown key 'RestartSecs'" in r.stdout + r.stderr


def _env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))


def test_the_systemd_instances_agree_with_the_router_and_their_configs():
    router = (SYSTEMD / "vllm-router.service").read_text()
    remotes = set()
    for name in ("a", "b"):
        env = _env(SYSTEMD / f"{name}.env")
        assert f"http://127.0.0.1:{env['PORT']}" in router
        cfg = parse_config(SYSTEMD / f"{name}.json")
        disk = next(t for t in cfg.tiers if t.kind == "disk")
        assert disk.options["path"].endswith(f"/{name}")  # each instance its own disk directory
        remotes.add(next(t.options["url"] for t in cfg.tiers if t.kind == "remote"))
    assert len(remotes) == 1  # one shared tier
    assert _env(SYSTEMD / "a.env")["CUDA_VISIBLE_DEVICES"] != _env(SYSTEMD / "b.env")["CUDA_VISIBLE_DEVICES"]


# ---------------------------------------------------------------- the node server (tierstore serve)

def _unit(path: Path) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit (no continuation lines), every value of a key in order."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def runnable(raw: dict, tmp_path: Path) -> dict:
    """A node config made to run on this machine: a 64 MiB host tier, the disk tier and the socket under
    ``tmp_path``, our own group in place of the allowed ones (same directory mode), /metrics on any free port."""
    tiers = [dict(t) for t in raw["tiers"]]
    tiers[0]["capacity"] = "64MiB"
    for t in tiers:
        if t["kind"] == "disk":
            t["path"] = str(tmp_path / "disk")
    serve = {**raw["serve"], "socket": str(tmp_path / "run" / Path(raw["serve"]["socket"]).name)}
    if serve.get("allow_gids"):
        serve["allow_gids"] = [os.getgid()]
    out = {**raw, "tiers": tiers, "serve": serve}
    if "metrics" in out:
        out["metrics"] = {**out["metrics"], "port": 0, "host": "127.0.0.1"}
    return out


def _mounted(pod: dict, container: dict, path: str) -> dict:
    """The volume a container mounts at ``path``."""
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    return {v["name"]: v for v in pod["volumes"]}[mounts[path]]


def daemonset_node_config() -> dict:
    """The node config the DaemonSet's server reads: its ``--config`` file, from the ConfigMap mounted there."""
    pod = by_kind("DaemonSet")["tierstore-node"]["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    path = Path(server["command"][server["command"].index("--config") + 1])
    source = _mounted(pod, server, str(path.parent))["configMap"]["name"]
    return yaml.safe_load(by_kind("ConfigMap")[source]["data"][path.name])


def node_configs() -> dict[str, dict]:
    return {"node-server/node.yaml": yaml.safe_load((NODE / "node.yaml").read_text()),
            "k8s DaemonSet": daemonset_node_config()}


def test_the_node_configs_agree():
    """The DaemonSet's ConfigMap is node.yaml with /metrics on the pod's address."""
    a, b = node_configs().values()
    assert {k: v for k, v in a.items() if k != "metrics"} == {k: v for k, v in b.items() if k != "metrics"}
    assert a["serve"]["socket"] == DEFAULT_SOCKET


@pytest.mark.parametrize("source", ["node-server/node.yaml", "k8s DaemonSet"])
def test_the_node_config_runs_a_node_server(source, tmp_path):
    raw = node_configs()[source]
    serve = parse_serve(raw["serve"])
    assert raw["tiers"][0]["kind"] == "host" and raw["tiers"][0]["capacity"]  # what a node server requires
    mine = runnable(raw, tmp_path)
    cfg = parse_config({k: v for k, v in mine.items() if k != "serve"})
    assert [t.kind for t in cfg.tiers] == [t["kind"] for t in raw["tiers"]] == ["host", "disk"]
    with NodeServer(mine).start() as server:
        dir_mode, sock_mode = access.modes(serve.allow_uids, serve.allow_gids)
        assert (dir_mode, sock_mode) == (0o710, 0o660)  # allow_gids: the engines' group may connect
        assert stat.S_IMODE(os.stat(os.path.dirname(server.config.socket)).st_mode) == dir_mode
        assert stat.S_IMODE(os.stat(server.config.socket).st_mode) == sock_mode
        with tierstore.open({"server": f"unix://{server.config.socket}"}) as store:
            items = [(key_of(i), chunk(i, 100_000)) for i in range(8)]
            assert store.put_many(items) == [True] * len(items)
            for (_, value), got in zip(items, store.get_many([k for k, _ in items]), strict=True):
                assert_same(got, value)


def test_the_node_server_unit_fits_the_node_config():
    unit = _unit(NODE / "tierstore-serve.service")
    raw = node_configs()["node-server/node.yaml"]
    serve = parse_serve(raw["serve"])
    binary, *args = unit["ExecStart"][0].split()
    assert binary.endswith("/tierstore") and args == ["serve", "--config", "/etc/tierstore/node.yaml"]
    assert unit["Restart"] == ["always"]
    # systemd makes the socket directory (/run is root's) with the mode the server itself asks for
    assert "/run/" + unit["RuntimeDirectory"][0] == os.path.dirname(serve.socket)
    assert int(unit["RuntimeDirectoryMode"][0], 8) == access.modes(serve.allow_uids, serve.allow_gids)[0]
    if serve.allow_gids:
        assert unit.get("SupplementaryGroups")  # the server gives the directory to that group: it must be in it
    disk = next(t for t in raw["tiers"] if t["kind"] == "disk")
    assert "/var/cache/" + unit["CacheDirectory"][0] == disk["path"]  # writable under ProtectSystem=strict
    assert unit["ProtectSystem"] == ["strict"] and unit["NoNewPrivileges"] == ["yes"]
    assert unit["PrivateTmp"] == ["yes"]


def test_the_server_takes_the_runtime_directory_of_the_unit_and_refuses_a_wider_one(tmp_path):
    """What the RuntimeDirectoryMode comment says: systemd's default 0755 would be refused."""
    mine = runnable(node_configs()["node-server/node.yaml"], tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o755)
    with pytest.raises(ConfigError, match="wider than 710"):
        NodeServer(mine)
    run.chmod(int(_unit(NODE / "tierstore-serve.service")["RuntimeDirectoryMode"][0], 8))
    NodeServer(mine).close()


# ---------------------------------------------------------------- Kubernetes

def manifests() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in manifests() if d["kind"] == kind}


def test_every_manifest_is_a_known_kind_with_a_name():
    known = {("apps/v1", "Deployment"), ("apps/v1", "DaemonSet"), ("v1", "Service"), ("v1", "ConfigMap"),
             ("v1", "Secret"), ("v1", "PersistentVolumeClaim")}
    docs = manifests()
    assert len(docs) >= 8
    for d in docs:
        assert (d["apiVersion"], d["kind"]) in known and d["metadata"]["name"], d
    assert set(by_kind("Deployment")) == {"engine-a", "engine-b", "vllm-router", "engine-node"}
    assert set(by_kind("DaemonSet")) == {"tierstore-node"}


def test_each_setup_is_applied_by_its_label():
    """README: ``kubectl apply -f k8s/ -l app.kubernetes.io/part-of=tierstore-kv`` (two engines, a shared tier)
    or ``...=tierstore-node`` (the node server and the engines using it)."""
    parts: dict[str, set[tuple[str, str]]] = {}
    for d in manifests():
        parts.setdefault(d["metadata"]["labels"]["app.kubernetes.io/part-of"], set()).add(
            (d["kind"], d["metadata"]["name"]))
    assert set(parts) == {"tierstore-kv", "tierstore-node"}
    assert parts["tierstore-node"] == {("ConfigMap", "tierstore-node-config"), ("DaemonSet", "tierstore-node"),
                                       ("Deployment", "engine-node"), ("Service", "engine-node")}


def workloads() -> dict[str, dict]:
    return {**by_kind("Deployment"), **by_kind("DaemonSet")}


def test_deployments_refer_only_to_what_is_defined():
    configmaps, pvcs, secrets = by_kind("ConfigMap"), by_kind("PersistentVolumeClaim"), by_kind("Secret")
    for name, dep in workloads().items():
        spec, pod = dep["spec"], dep["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), name
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, (name, v)
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs, (name, v)
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
            ports = {p["name"] for p in c.get("ports", [])}
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, (name, m)
            for ref in c.get("envFrom", []):
                assert ref["secretRef"]["name"] in secrets, (name, ref)
            probe = c.get("readinessProbe", {}).get("httpGet")
            if probe:
                assert probe["port"] in ports, (name, probe)


def test_services_select_pods_and_name_their_ports():
    deployments = by_kind("Deployment")
    for name, svc in by_kind("Service").items():
        pods = [d for d in deployments.values()
                if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pods) == 1, name
        container_ports = {p["name"] for c in pods[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in container_ports, (name, p)


def _args(dep: dict) -> list[str]:
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_router_reaches_both_engines_through_their_services():
    services, deployments = by_kind("Service"), by_kind("Deployment")
    args = _args(deployments["vllm-router"])
    urls = args[args.index("--worker-urls") + 1:]
    assert len(urls) == 2
    for url in urls:
        u = urlparse(url)
        assert u.hostname in services and u.port in [p["port"] for p in services[u.hostname]["spec"]["ports"]]
        engine = _args(deployments[u.hostname])
        assert engine[engine.index("--port") + 1] == str(u.port)  # the engine listens where its Service sends


def test_the_engines_read_a_tierstore_config_that_tierstore_accepts():
    configmaps = by_kind("ConfigMap")
    for name in ("engine-a", "engine-b"):
        dep = by_kind("Deployment")[name]
        args = _args(dep)
        kv = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "TierstoreConnector" and kv["kv_connector_module_path"] == "tierstore_vllm"
        path = Path(kv["kv_connector_extra_config"]["config"])
        pod = dep["spec"]["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        source = volumes[mounts[str(path.parent)]]["configMap"]["name"]
        text = configmaps[source]["data"][path.name]
        cfg = parse_config(json.loads(text))
        remote = next(t for t in cfg.tiers if t.kind == "remote")
        shared_mount = urlparse(remote.options["url"]).path
        assert volumes[mounts[shared_mount]].get("persistentVolumeClaim"), "the shared tier is the shared volume"
        disk = next(t for t in cfg.tiers if t.kind == "disk")
        assert "emptyDir" in volumes[mounts[disk.options["path"]]]  # each pod its own disk tier


def test_the_daemonset_serves_the_node_config_on_host_paths():
    ds = by_kind("DaemonSet")["tierstore-node"]
    assert (ds["apiVersion"], ds["kind"]) == ("apps/v1", "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    assert server["command"][:3] == ["tierstore", "serve", "--config"]
    raw = daemonset_node_config()
    serve = parse_serve(raw["serve"])
    socket_dir = os.path.dirname(serve.socket)
    # the socket's directory and the disk tier are the node's, so engine pods and the next server find them
    socket_volume = _mounted(pod, server, socket_dir)["hostPath"]
    assert socket_volume["type"] == "DirectoryOrCreate"
    disk = next(t for t in raw["tiers"] if t["kind"] == "disk")
    assert "hostPath" in _mounted(pod, server, disk["path"])
    assert server["readinessProbe"]["exec"]["command"] == ["test", "-S", serve.socket]
    # kubelet makes a missing hostPath root:root 0755; the init container hands both to the server's user with
    # the mode the server asks for, and the server must be in the allowed group to give the socket to it
    ctx = pod["securityContext"]
    assert set(serve.allow_gids) <= set(ctx["supplementalGroups"])
    (init,) = pod["initContainers"]
    script = init["command"][-1]
    assert f"chown {ctx['runAsUser']}:{ctx['runAsGroup']} {socket_dir} {disk['path']}" in script
    assert f"chmod {access.modes(serve.allow_uids, serve.allow_gids)[0]:04o} {socket_dir}" in script
    assert {_mounted(pod, init, p)["name"] for p in (socket_dir, disk["path"])} == \
        {_mounted(pod, server, p)["name"] for p in (socket_dir, disk["path"])}
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert ports["tierstore-metrics"] == raw["metrics"]["port"]


def test_the_engines_reach_the_node_server_through_the_same_host_path():
    ds_pod = by_kind("DaemonSet")["tierstore-node"]["spec"]["template"]["spec"]
    serve = parse_serve(daemonset_node_config()["serve"])
    assert serve.socket == parse_serve(node_configs()["node-server/node.yaml"]["serve"]).socket
    socket_dir = os.path.dirname(serve.socket)
    host_dir = _mounted(ds_pod, ds_pod["containers"][0], socket_dir)["hostPath"]["path"]
    pod = by_kind("Deployment")["engine-node"]["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    cmd = engine["command"]
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "TierstoreConnector" and kv["kv_connector_module_path"] == "tierstore_vllm"
    config = kv["kv_connector_extra_config"]["config"]
    assert config == {"server": "unix://" + serve.socket, "server_uid": ds_pod["securityContext"]["runAsUser"]}
    # the node's socket directory (not the socket file: a restarted server makes a new one) where the URL points
    assert _mounted(pod, engine, socket_dir)["hostPath"]["path"] == host_dir
    assert pod["securityContext"]["runAsGroup"] in serve.allow_gids  # what SO_PEERCRED reports to the server
    with tierstore.open(config) as store:  # a client config tierstore accepts (no server here: misses)
        assert store.get(key_of(0)) is None
