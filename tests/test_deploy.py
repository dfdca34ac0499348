"""Deployment checked without a cluster: render every overlay, validate strictly, check the wiring."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "k8s" / "overlays").iterdir())
KUBERNETES_VERSION = "1.33"
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    assert path, f"{name} is installed by `make setup` (requirements.lock); run make test"
    return path


def render(overlay: str) -> list[dict[str, Any]]:
    output = subprocess.run(
        [_tool("kubectl"), "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(output) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def component(obj: dict[str, Any]) -> str:
    return obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def pod_labels(objects: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [d["spec"]["template"]["metadata"]["labels"] for d in of_kind(objects, "Deployment")]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_the_overlays_exist():
    assert {"cpu", "gpu", "tls"} <= set(OVERLAYS)


def test_every_object_validates_strictly(rendered):
    _, objects = rendered
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_strict_validation_catches_unknown_fields(rendered):
    deployment = json.loads(json.dumps(of_kind(rendered[1], "Deployment")[0]))
    deployment["spec"]["template"]["spec"]["containers"][0]["probeTimeout"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_expected_objects(rendered):
    _, objects = rendered
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for role in ("target", "draft", "orchestrator", "gateway"):
        assert ("Deployment", f"specdec-{role}") in kinds
        assert ("Service", f"specdec-{role}") in kinds
        assert ("PodDisruptionBudget", f"specdec-{role}") in kinds
    assert ("HorizontalPodAutoscaler", "specdec-orchestrator") in kinds
    assert ("HorizontalPodAutoscaler", "specdec-gateway") in kinds
    assert any(kind == "ConfigMap" for kind, _ in kinds)
    services = {o["metadata"]["name"]: o for o in of_kind(objects, "Service")}
    assert services["specdec-target"]["spec"]["clusterIP"] == "None"
    assert services["specdec-draft"]["spec"]["clusterIP"] == "None"


def test_probes_use_grpc_or_http_health_on_a_container_port(rendered):
    overlay, objects = rendered
    for deployment in of_kind(objects, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            ports = {p["containerPort"] for p in container["ports"]}
            names = {p["name"] for p in container["ports"]}
            env = {e["name"]: e.get("value") for e in container["env"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if component(deployment) == "gateway":
                    # Readiness follows the orchestrator; liveness and start-up are the gateway's own.
                    assert container[probe]["httpGet"]["path"] == ("/ready" if probe == "readinessProbe" else "/health")
                    assert container[probe]["httpGet"]["port"] in names
                    assert (container[probe]["httpGet"].get("scheme") == "HTTPS") == ("SPECDEC_TLS_CERT" in env)
                    continue
                port = container[probe]["grpc"]["port"]
                assert port in ports, (deployment["metadata"]["name"], probe)
                # The health-only port: its own threads (streams cannot starve it) and plaintext (with TLS).
                assert str(port) == env["SPECDEC_HEALTH_PORT"], (overlay, deployment["metadata"]["name"])
            startup = container["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # room to load a model


def test_services_and_pdbs_select_pods(rendered):
    _, objects = rendered
    labels = pod_labels(objects)
    for service in of_kind(objects, "Service"):
        matched = [pl for pl in labels if selects(service["spec"]["selector"], pl)]
        assert len(matched) == 1, service["metadata"]["name"]
        deployment = next(
            d for d in of_kind(objects, "Deployment") if d["spec"]["template"]["metadata"]["labels"] == matched[0]
        )
        port_names = {p["name"] for c in deployment["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    for pdb in of_kind(objects, "PodDisruptionBudget"):
        assert sum(selects(pdb["spec"]["selector"]["matchLabels"], pl) for pl in labels) == 1
    for deployment in of_kind(objects, "Deployment"):
        assert selects(
            deployment["spec"]["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"]
        )


def test_every_container_has_requests_and_limits(rendered):
    _, objects = rendered
    for deployment in of_kind(objects, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            assert {"cpu", "memory"} <= set(container["resources"]["limits"])


def test_gpus_only_for_draft_and_target_on_gpu(rendered):
    overlay, objects = rendered
    for deployment in of_kind(objects, "Deployment"):
        resources = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
        wants_gpu = "nvidia.com/gpu" in resources.get("limits", {})
        assert wants_gpu == (overlay == "gpu" and component(deployment) in ("draft", "target"))
        if wants_gpu:
            spec = deployment["spec"]["template"]["spec"]
            assert spec["nodeSelector"]["specdec.io/pool"] == component(deployment)
            other = "draft" if component(deployment) == "target" else "target"
            terms = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert any(t["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == other for t in terms)


def test_network_policies_admit_only_the_orchestrator_to_the_services(rendered):
    _, objects = rendered
    policies = {
        p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: p
        for p in of_kind(objects, "NetworkPolicy")
    }
    assert set(policies) == {"draft", "target", "orchestrator"}
    gateway_rule = policies.pop("orchestrator")["spec"]["ingress"][0]
    assert {p["port"] for p in gateway_rule["ports"]} == {50050}
    peers = [peer["podSelector"]["matchLabels"] for peer in gateway_rule["from"]]
    assert {"app.kubernetes.io/name": "specdec", "app.kubernetes.io/component": "gateway"} in peers
    for policy in policies.values():
        for rule in policy["spec"]["ingress"]:
            ports = {p["port"] for p in rule["ports"]}
            if 50051 in ports:
                peers = rule["from"]
                assert len(peers) == 1
                assert peers[0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "orchestrator"
            else:
                assert ports == {9090, 50052}  # metrics and the health-only port


def test_restricted_security_context(rendered):
    _, objects = rendered
    for deployment in of_kind(objects, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["readOnlyRootFilesystem"] is True
            assert context["capabilities"]["drop"] == ["ALL"]


def test_grace_period_covers_the_drain(rendered):
    _, objects = rendered
    for deployment in of_kind(objects, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert pod["terminationGracePeriodSeconds"] > float(env["SPECDEC_GRACE_PERIOD_S"])


def test_config_keys_exist_and_env_names_are_real_flags(rendered):
    from http_gateway.__main__ import GatewayConfig
    from model_host.config import ModelServiceConfig
    from orchestrator.config import OrchestratorConfig

    _, objects = rendered
    config = of_kind(objects, "ConfigMap")[0]
    names = {config["metadata"]["name"]}
    fields = {
        f.upper()
        for config_type in (ModelServiceConfig, OrchestratorConfig, GatewayConfig)
        for f in config_type.__dataclass_fields__
    }
    for deployment in of_kind(objects, "Deployment"):
        for entry in deployment["spec"]["template"]["spec"]["containers"][0]["env"]:
            if entry["name"].startswith("SPECDEC_"):
                assert entry["name"].removeprefix("SPECDEC_") in fields, entry["name"]
            ref = entry.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                assert ref["name"] in names and ref["key"] in config["data"], ref


def test_dockerfile_lints_clean():
    result = subprocess.run(
        [_tool("hadolint"), "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^USER 10001$", text, re.M) and "ARG VARIANT=cpu" in text


def test_dashboard_queries_real_metrics():
    from prometheus_client import REGISTRY

    from model_host import metrics as model_metrics  # noqa: F401
    from orchestrator import metrics as orchestrator_metrics  # noqa: F401 - registers the metrics

    families = {family.name for family in REGISTRY.collect()}
    dashboard = json.loads((DEPLOY / "grafana" / "specdec-dashboard.json").read_text())
    queried = {
        re.sub(r"_(total|bucket|sum|count)$", "", name)
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"specdec:[a-z0-9_:]+", target["expr"])
    }
    assert queried and queried <= families, queried - families


def test_tls_overlay_mounts_what_the_cert_manager_example_issues():
    example = [
        doc for doc in yaml.safe_load_all((DEPLOY / "k8s" / "examples" / "cert-manager.yaml").read_text()) if doc
    ]
    issued = {d["spec"]["secretName"]: d["spec"] for d in example if d["kind"] == "Certificate"}
    objects = render("tls")
    for deployment in of_kind(objects, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        assert "specdec-tls" in secrets and "specdec-tls" in issued
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        if "SPECDEC_UPSTREAM_TLS_SERVER_NAME" in env:
            assert env["SPECDEC_UPSTREAM_TLS_SERVER_NAME"] in issued["specdec-tls"]["dnsNames"]
        if component(deployment) in ("orchestrator", "gateway"):
            assert "specdec-api-keys" in secrets and env["SPECDEC_API_KEY_FILE"].startswith("/etc/specdec/keys/")


def test_the_image_keeps_the_default_pair_where_the_config_points():
    text = (DEPLOY / "Dockerfile").read_text()
    config = of_kind(render("cpu"), "ConfigMap")[0]["data"]
    assert config["target_model"].startswith("/opt/specdec/default_models/pair/")
    assert "/opt/specdec/default_models" in text


def _image_module() -> Any:
    """deploy/image/image.py, which is a script, not a package."""
    spec = importlib.util.spec_from_file_location("deploy_image", DEPLOY / "image" / "image.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_image_test_runs_the_containers_with_the_manifests_arguments():
    """`make image-test` starts each container with what the cpu overlay gives its pod: the args, every
    environment variable (ConfigMap keys resolved), the user, the read-only root, /tmp, the ports."""
    image = _image_module()
    objects = render("cpu")
    containers = image.containers_from_manifests(objects)
    config = next(o for o in objects if o["kind"] == "ConfigMap")["data"]
    deployments = of_kind(objects, "Deployment")
    assert set(containers) == {component(d) for d in deployments} == set(image.ROLES)
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        (spec,) = pod["containers"]
        command = containers[component(deployment)].run_arguments("IMAGE")
        at = command.index("IMAGE")
        assert command[at + 1 :] == spec["args"]
        assert command[command.index("--name") + 1] == deployment["metadata"]["name"]
        passed = {command[i + 1] for i, word in enumerate(command[:at]) if word == "--env"}
        for variable in spec["env"]:
            value = variable.get("value")
            if value is None:
                value = config[variable["valueFrom"]["configMapKeyRef"]["key"]]
            assert f"{variable['name']}={value}" in passed, variable
        assert len(passed) == len(spec["env"])
        security = {**pod["securityContext"], **spec.get("securityContext", {})}
        assert command[command.index("--user") + 1] == f"{security['runAsUser']}:{security['runAsGroup']}"
        assert ("--read-only" in command) == bool(security.get("readOnlyRootFilesystem")) is True
        mounts = {m["mountPath"] for m in spec.get("volumeMounts", [])}
        assert "/tmp" in mounts and "/tmp:rw,mode=1777" in command
        published = {command[i + 1] for i, word in enumerate(command[:at]) if word == "--publish"}
        assert published == {f"127.0.0.1::{p['containerPort']}" for p in spec["ports"]}
