"""examples/deploy stays deployable: the systemd units pass ``systemd-analyze verify``, the Kubernetes manifests
refer only to what they define (labels, volumes, ports, Services, the ConfigMap key the connector reads), and
every tierstore config in them is one tierstore accepts. The launch script itself runs real engines in
``make test-engines`` (tests/engines/test_vllm_deploy.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from tierstore.config import parse_config

DEPLOY = Path(__file__).resolve().parents[1] / "examples" / "deploy"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"


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
    for unit in SYSTEMD.glob("*.service"):
        shutil.copy(unit, units)
    bin_dir = root / "opt/vllm/bin"
    bin_dir.mkdir(parents=True)
    for name in ("vllm", "vllm-router"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    return root


def verify(root: Path, *units: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "verify", f"--root={root}", *units], capture_output=True, text=True,
                          cwd=root)


def test_the_systemd_units_verify_cleanly(systemd_root):
    r = verify(systemd_root, "tierstore-vllm@a.service", "tierstore-vllm@b.service", "vllm-router.service")
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


# ---------------------------------------------------------------- Kubernetes

def manifests() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in manifests() if d["kind"] == kind}


def test_every_manifest_is_a_known_kind_with_a_name():
    known = {("apps/v1", "Deployment"), ("v1", "Service"), ("v1", "ConfigMap"), ("v1", "Secret"),
             ("v1", "PersistentVolumeClaim")}
    docs = manifests()
    assert len(docs) >= 8
    for d in docs:
        assert (d["apiVersion"], d["kind"]) in known and d["metadata"]["name"], d
    assert set(by_kind("Deployment")) == {"engine-a", "engine-b", "vllm-router"}


def test_deployments_refer_only_to_what_is_defined():
    configmaps, pvcs, secrets = by_kind("ConfigMap"), by_kind("PersistentVolumeClaim"), by_kind("Secret")
    for name, dep in by_kind("Deployment").items():
        spec, pod = dep["spec"], dep["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), name
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, (name, v)
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs, (name, v)
        for c in pod["spec"]["containers"]:
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
