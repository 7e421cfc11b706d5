"""deploy/: every manifest parses, and what ties the manifests to each other and to the code holds: one image
built on the Ray and Python that pyproject pins, the ports, the GPUs, the Ray address the API joins, and the
metric names the Grafana dashboard queries. Pure parsing: no Ray, no cluster, no Docker."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shlex
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
RAY_PIN = next(re.fullmatch(r"ray\[default\]==([\d.]+)", d)[1] for d in PROJECT["project"]["dependencies"]
               if d.startswith("ray["))
MIN_PYTHON = tuple(int(n) for n in re.fullmatch(r">=(\d+)\.(\d+)", PROJECT["project"]["requires-python"]).groups())


# --- readers ----------------------------------------------------------------------------------------------


def yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kuberay(kind: str) -> dict:
    """The one object of `kind` in what `kubectl apply -f deploy/kuberay/` applies (the folder, not below it)."""
    found = [d for p in sorted((DEPLOY / "kuberay").glob("*.yaml")) for d in yaml_docs(p) if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/kuberay/, found {len(found)}"
    return found[0]


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) for each instruction of deploy/Dockerfile, continuation lines joined."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def instruction(name: str) -> list[str]:
    return [args for ins, args in dockerfile() if ins == name]


def shell_commands(script: str) -> list[list[str]]:
    """The words of each simple command of a shell script (split at newlines, ';', '&&' and a lone '&')."""
    parts = re.split(r"\n|;|&&|(?<![>&])&(?![>&])", script.replace("\\\n", " "))
    return [words for part in parts if (words := shlex.split(part, comments=True))]


def find_command(commands: list[list[str]], *prefix: str) -> tuple[int, list[str]]:
    """The position and words of the first command that starts with `prefix` (after an `exec` or `nohup`)."""
    for i, words in enumerate(commands):
        while words and words[0] in ("exec", "nohup"):
            words = words[1:]
        if tuple(words[: len(prefix)]) == prefix:
            return i, words
    raise AssertionError(f"no command starts with {' '.join(prefix)!r} in {commands}")


def option(words: list[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE`."""
    for i, word in enumerate(words):
        if word == name and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def ray_pods() -> list[dict]:
    """The pod templates of the RayCluster's head and worker groups."""
    spec = kuberay("RayCluster")["spec"]
    return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]


def api_container() -> dict:
    (container,) = kuberay("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def api_script() -> list[list[str]]:
    container = api_container()
    return shell_commands(" ".join(container.get("command", [])[2:] + container.get("args", [])))


def port_number(container: dict, port: int | str) -> int:
    """A container port given by number or by name."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return number


def env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def load_dashboard_generator():
    spec = importlib.util.spec_from_file_location("trainyard_dashboard", DEPLOY / "grafana" / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "trainyard.json").read_text())


def dashboard_queries() -> list[str]:
    """Every PromQL the dashboard runs: its panels' targets and its variables' queries."""
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    return exprs + [v["query"]["query"] for v in dashboard()["templating"]["list"] if v["type"] == "query"]


def dashboard_metrics() -> set[str]:
    """The trainyard metric names the dashboard queries, as the code names them (without Ray's `ray_` prefix)."""
    return {name.removeprefix("ray_") for q in dashboard_queries() for name in re.findall(r"\bray_\w+", q)}


def metrics_in_code() -> set[str]:
    """Names of the Ray metrics (Gauge, Counter, Histogram) that actors/ and parallel/ define."""
    definition = re.compile(r"\b(?:Gauge|Counter|Histogram)\(\s*[\"'](trainyard_\w+)[\"']")
    files = [f for folder in ("actors", "parallel") for f in sorted((ROOT / folder).rglob("*.py"))]
    return {name for f in files for name in definition.findall(f.read_text())}


# --- everything parses ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.yaml")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_under_deploy_parses(path):
    docs = yaml_docs(path)
    assert docs and all(isinstance(d, dict) for d in docs)
    if "kuberay" in path.parts:
        for d in docs:
            assert d["apiVersion"] and d["kind"] and d["metadata"]["name"], d


def test_kubectl_apply_of_the_kuberay_folder_creates_the_cluster_and_the_api():
    assert kuberay("RayCluster")["apiVersion"] == "ray.io/v1"
    for kind in ("Deployment", "Service", "PersistentVolumeClaim"):
        assert kuberay(kind)["apiVersion"] in ("v1", "apps/v1")


# --- the Grafana dashboard --------------------------------------------------------------------------------


def test_committed_dashboard_is_what_the_generator_writes():
    generator = load_dashboard_generator()
    assert (DEPLOY / "grafana" / "trainyard.json").read_text() == generator.render(), (
        "deploy/grafana/trainyard.json is stale: run `python deploy/grafana/dashboard.py`")


def test_dashboard_is_grafana_json_with_a_datasource_and_a_job_variable():
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    job = variables["job_id"]
    assert job["type"] == "query" and job["includeAll"] and job["multi"]
    assert re.fullmatch(r"label_values\(ray_trainyard_\w+, job_id\)", job["query"]["query"])
    assert job["datasource"]["uid"] == "${datasource}"

    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    assert {p["title"] for p in panels} >= {"Loss", "Tokens per second", "Step time", "Pipeline bubble",
                                            "Expert load", "Load-balancing loss", "Router z-loss", "Dropped tokens"}
    for p in panels:
        assert p["type"] == "timeseries" and p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        assert p["fieldConfig"]["defaults"]["unit"], p["title"]
        assert 0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        for t in p["targets"]:
            assert 'job_id=~"$job_id"' in t["expr"], (p["title"], t["expr"])


def test_dashboard_queries_the_names_ray_exports():
    # Ray's Prometheus export names an application metric `ray_<name>`: Gauge("trainyard_loss") is scraped as
    # ray_trainyard_loss (ray/_private/telemetry/open_telemetry_metric_recorder.py, NAMESPACE = "ray").
    for query in dashboard_queries():
        assert re.findall(r"\w*trainyard_\w+", query), query
        for name in re.findall(r"\w*trainyard_\w+", query):
            assert name.startswith("ray_trainyard_"), (name, query)


@pytest.mark.parametrize("name", sorted(dashboard_metrics()))
def test_every_metric_the_dashboard_queries_is_defined_in_the_code(name):
    defined = metrics_in_code()
    assert name in defined, f"the dashboard queries {name}, which actors/ and parallel/ never define"


def test_every_metric_in_the_code_is_on_the_dashboard():
    assert metrics_in_code() >= {"trainyard_loss", "trainyard_tokens_per_s"}  # the scan finds the coordinator's
    assert metrics_in_code() - dashboard_metrics() == set()


# --- the image --------------------------------------------------------------------------------------------


def test_image_builds_on_the_pinned_ray_and_a_supported_python():
    (base,) = instruction("FROM")
    m = re.fullmatch(r"rayproject/ray:([\d.]+)-py(\d)(\d+)-gpu", base)
    assert m, f"expected Ray's CUDA image, rayproject/ray:<version>-py<XY>-gpu, got {base}"
    assert m[1] == RAY_PIN, f"the image has Ray {m[1]}, pyproject pins {RAY_PIN}"
    assert (int(m[2]), int(m[3])) >= MIN_PYTHON


def product_folders() -> tuple[str, ...]:
    """The folders setup.py installs as trainyard's subpackages."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    (folders,) = [node.value for node in tree.body if isinstance(node, ast.Assign) and node.targets[0].id == "FOLDERS"]
    return ast.literal_eval(folders)


def test_image_installs_every_package_and_torch():
    copied = {source for args in instruction("COPY") for source in [w for w in args.split() if w[:2] != "--"][:-1]}
    for package in [*product_folders(), "trainyard", "setup.py", PROJECT["project"]["readme"], "pyproject.toml"]:
        assert package in copied, f"deploy/Dockerfile never copies {package}"
    runs = " ".join(instruction("RUN"))
    assert '"torch>=2.11"' in runs and "pip install --no-cache-dir ." in runs


def test_image_serves_the_port_it_exposes():
    (exposed,) = instruction("EXPOSE")
    (cmd,) = instruction("CMD")
    words = json.loads(cmd)
    assert words[:2] == ["trainyard", "serve"] and option(words, "--host") == "0.0.0.0"
    assert option(words, "--port") == exposed


# --- KubeRay ----------------------------------------------------------------------------------------------


def test_raycluster_runs_the_pinned_ray_with_token_auth_and_an_autoscaled_gpu_group():
    spec = kuberay("RayCluster")["spec"]
    assert spec["rayVersion"] == RAY_PIN and spec["enableInTreeAutoscaling"] is True
    assert spec["authOptions"]["mode"] == "token"
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # ranks go to the GPU workers
    assert spec["workerGroupSpecs"]
    for group in spec["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
        (container,) = group["template"]["spec"]["containers"]
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        gpus = int(limits["nvidia.com/gpu"])
        assert gpus > 0 and int(requests["nvidia.com/gpu"]) == gpus
        assert int(group["rayStartParams"]["num-gpus"]) == gpus, "Ray would advertise other GPUs than the pod has"
        assert int(limits["cpu"]) >= gpus, "each rank needs a CPU beside its GPU"


def test_one_image_for_the_ray_pods_and_the_api_tagged_with_the_version():
    images = {c["image"] for pod in ray_pods() for c in pod["spec"]["containers"]} | {api_container()["image"]}
    assert images == {f"trainyard:{PROJECT['project']['version']}"}
    built = re.search(r"docker build -f deploy/Dockerfile -t (\S+) \.", (DEPLOY / "Dockerfile").read_text())
    assert built and built[1] in images, "the Dockerfile's build command tags another image than the manifests use"


def test_api_joins_the_rayclusters_head_service_through_a_local_raylet():
    cluster = kuberay("RayCluster")
    head = cluster["spec"]["headGroupSpec"]
    (head_container,) = head["template"]["spec"]["containers"]
    gcs_port = int(head["rayStartParams"].get("port", port_number(head_container, "gcs-server")))
    address = f"{cluster['metadata']['name']}-head-svc:{gcs_port}"  # the Service KubeRay creates for the head

    script = api_script()
    started_at, ray_start = find_command(script, "ray", "start")
    served_at, serve = find_command(script, "trainyard", "serve")
    # ray.init(address="host:port") attaches the driver to a raylet on its own machine: start one first.
    assert started_at < served_at
    assert option(ray_start, "--address") == address and option(serve, "--ray-address") == address
    assert option(ray_start, "--num-cpus") == "0" and option(ray_start, "--num-gpus") == "0"


def test_api_serves_on_the_port_the_image_exposes_and_the_service_targets():
    deployment, service = kuberay("Deployment"), kuberay("Service")
    container = api_container()
    _, serve = find_command(api_script(), "trainyard", "serve")
    port = int(option(serve, "--port"))
    assert option(serve, "--host") == "0.0.0.0"
    assert port == port_number(container, "http") == int(instruction("EXPOSE")[0])
    (service_port,) = service["spec"]["ports"]
    assert port_number(container, service_port["targetPort"]) == port
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/healthz" and port_number(container, get["port"]) == port
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"


def test_api_uses_the_ray_token_kuberay_generates_for_the_cluster():
    variables = env(api_container())
    assert variables["RAY_AUTH_MODE"]["value"] == "token"
    ref = variables["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": kuberay("RayCluster")["metadata"]["name"], "key": "auth_token"}


def test_api_keeps_its_state_on_a_volume_with_the_token_from_a_secret():
    container = api_container()
    (image_env,) = [args for args in instruction("ENV") if args.startswith("TRAINYARD_STATE_DIR=")]
    state_dir = env(container)["TRAINYARD_STATE_DIR"]["value"]  # where `serve` and `kubectl exec trainyard` look
    assert image_env == f"TRAINYARD_STATE_DIR={state_dir}"
    volumes = {v["name"]: v for v in kuberay("Deployment")["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    claim = volumes[mounts[state_dir]["name"]]["persistentVolumeClaim"]["claimName"]
    assert claim == kuberay("PersistentVolumeClaim")["metadata"]["name"]
    token = mounts[f"{state_dir}/token"]  # `trainyard serve` reads the state dir's token file if it exists
    assert volumes[token["name"]]["secret"]["secretName"] and token["subPath"] == "token"


def test_prometheus_scrapes_ray_metrics_of_every_trainyard_pod():
    (monitor,) = yaml_docs(DEPLOY / "kuberay" / "monitoring" / "podmonitor.yaml")
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    api_pod = kuberay("Deployment")["spec"]["template"]
    for pod in ray_pods() + [api_pod]:
        assert selector.items() <= pod["metadata"]["labels"].items()
        (container,) = pod["spec"]["containers"]
        assert port_number(container, endpoint["port"]) == 8080  # KubeRay's metrics-export-port
    assert option(find_command(api_script(), "ray", "start")[1], "--metrics-export-port") == "8080"


# --- ray up -----------------------------------------------------------------------------------------------


def ray_up() -> dict:
    (config,) = yaml_docs(DEPLOY / "ray-cluster.yaml")
    return config


def test_ray_up_config_is_valid_for_the_pinned_ray():
    # Ray's own schema of cluster configs, read from the installed package (which is the pinned version).
    ray_dir = Path(importlib.util.find_spec("ray").submodule_search_locations[0])
    schema = json.loads((ray_dir / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(ray_up(), schema)


def test_ray_up_runs_the_images_ray_and_installs_torch_and_this_checkout():
    config = ray_up()
    assert config["docker"]["image"] == instruction("FROM")[0]
    checkout = next(remote for remote, local in config["file_mounts"].items() if local == ".")
    setup = " ".join(config["setup_commands"])
    assert '"torch>=2.11"' in setup and f"pip install --no-cache-dir {checkout}" in setup


def test_ray_up_starts_gpu_workers_on_the_heads_port_and_serves_trainyard_on_the_head():
    config = ray_up()
    head_commands = shell_commands("\n".join(config["head_start_ray_commands"]))
    started_at, head_start = find_command(head_commands, "ray", "start")
    assert "--head" in head_start
    _, worker_start = find_command(shell_commands("\n".join(config["worker_start_ray_commands"])), "ray", "start")
    assert option(worker_start, "--address") == f"$RAY_HEAD_IP:{option(head_start, '--port')}"
    served_at, serve = find_command(head_commands, "trainyard", "serve")
    assert started_at < served_at
    assert option(serve, "--ray-address") == "auto" and option(serve, "--port") == instruction("EXPOSE")[0]

    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"]["CPU"] == 0  # ranks go to the GPU workers
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    assert workers and all(t["resources"]["GPU"] > 0 for t in workers)
    for t in workers:
        assert t["resources"]["CPU"] >= t["resources"]["GPU"], "each rank needs a CPU beside its GPU"
        assert 0 < t["min_workers"] <= t["max_workers"] <= config["max_workers"]
