"""deploy/kubernetes/: every manifest valid against a pinned Kubernetes schema (strict, offline),
and the references between them and to the server consistent."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ascend_vlm.__main__ import build_parser
from ascend_vlm.serving.metrics import ServingMetrics

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
# A release kubernetes-validate bundles; 1.30 is the first with the preStop sleep action on.
KUBERNETES_VERSION = "1.32.0"


def resources() -> list[tuple[str, dict]]:
    """(file name, resource) for every document of every manifest."""
    return [
        (path.name, document)
        for path in sorted(MANIFESTS.glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text(encoding="utf-8"))
        if document
    ]


def resource(kind: str) -> dict:
    (found,) = [document for _, document in resources() if document["kind"] == kind]
    return found


def server_container() -> dict:
    (container,) = resource("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def serve_arguments():
    """The container's command line as the server's own parser reads it."""
    container = server_container()
    assert container["command"] == ["python"]
    assert container["args"][:2] == ["-m", "ascend_vlm"]
    return build_parser().parse_args(container["args"][2:])


def server_counters() -> set[str]:
    """The counters the server exports at /metrics, as Prometheus names their series."""
    metrics = ServingMetrics(lambda: 0, lambda: 0, lambda: 0, lambda: 0, lambda: None)
    families = text_string_to_metric_families(metrics.exposition().decode())
    return {f"{family.name}_total" for family in families if family.type == "counter"}


def adapter_rules() -> list[dict]:
    return yaml.safe_load(resource("ConfigMap")["data"]["config.yaml"])["rules"]


@pytest.mark.parametrize(
    "name, document", resources(), ids=[f"{n}:{d['kind']}" for n, d in resources()]
)
def test_every_manifest_is_valid_kubernetes(name, document):
    validated = kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    assert validated == "1.32"


def test_the_validation_is_strict_and_would_catch_a_typo():
    deployment = resource("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_service_selects_the_deployments_pods():
    deployment, service = resource("Deployment"), resource("Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    port_names = {port["name"] for port in server_container()["ports"]}
    assert {port["targetPort"] for port in service["spec"]["ports"]} <= port_names
    assert service["spec"]["sessionAffinity"] == "ClientIP"


def test_the_autoscaler_scales_the_deployment_on_the_adapters_two_metrics():
    autoscaler, deployment = resource("HorizontalPodAutoscaler"), resource("Deployment")
    assert autoscaler["spec"]["scaleTargetRef"] == {
        "apiVersion": deployment["apiVersion"],
        "kind": deployment["kind"],
        "name": deployment["metadata"]["name"],
    }
    scaled_on = [metric["pods"]["metric"]["name"] for metric in autoscaler["spec"]["metrics"]]
    assert scaled_on == [rule["name"]["as"] for rule in adapter_rules()]
    assert all(metric["type"] == "Pods" for metric in autoscaler["spec"]["metrics"])


def test_the_adapter_rules_rate_exactly_the_servers_counters():
    rules = adapter_rules()
    series = [re.fullmatch(r"(\w+)\{.*\}", rule["seriesQuery"]).group(1) for rule in rules]
    assert series == ["ascend_vlm_requests_total", "ascend_vlm_visual_tokens_total"]
    assert set(series) <= server_counters()
    assert [rule["name"]["matches"] for rule in rules] == [f"^{name}$" for name in series]
    for rule in rules:
        assert "rate(<<.Series>>{<<.LabelMatchers>>}[1m])" in rule["metricsQuery"]
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}


def test_the_container_runs_the_serve_command_the_server_accepts():
    arguments = serve_arguments()
    assert arguments.parser.prog.endswith("serve")
    (mount,) = server_container()["volumeMounts"]
    assert arguments.model.startswith(mount["mountPath"] + "/")


def test_the_probes_and_scrape_annotations_reach_the_servers_port_and_paths():
    container = server_container()
    port = serve_arguments().port
    (http,) = container["ports"]
    assert http["containerPort"] == port
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": http["name"]}
    annotations = resource("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_model_volume_is_the_claim_the_container_mounts():
    pod = resource("Deployment")["spec"]["template"]["spec"]
    (volume,) = pod["volumes"]
    claim = resource("PersistentVolumeClaim")["metadata"]["name"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim
    (mount,) = server_container()["volumeMounts"]
    assert mount["name"] == volume["name"]


def test_one_ascend_npu_is_requested_under_the_device_plugins_name():
    resources_ = server_container()["resources"]
    assert resources_["requests"]["huawei.com/Ascend910"] == 1
    assert resources_["limits"]["huawei.com/Ascend910"] == 1


def test_the_grace_period_covers_the_prestop_sleep_and_the_servers_drain():
    # /health answers 503 while the server drains: readiness takes the pod out of the Service,
    # and liveness must not restart it before the drain ends.
    container = server_container()
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = serve_arguments().drain_seconds
    grace = resource("Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop + drain
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > drain
