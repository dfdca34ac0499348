"""`make image` and `make image-test`: the Dockerfile built, and run as the Kubernetes base deploys it.

    python deploy/image/image.py build [--variant cpu|cuda] [--tag T] [--python-image IMAGE]
    python deploy/image/image.py test  [--tag T] [--python-image IMAGE]

Builders: podman (rootful; `deploy/image/containers.conf` is its configuration, through
CONTAINERS_CONF), or docker where its daemon answers. With podman, this machine's pip configuration
and the local folders and indexes it names are mounted read-only into the build's RUN steps (never
into a layer), and the first local index becomes the CPU build's torch index.

`test` builds the CPU variant, checks the image's user and read-only root, starts target, draft,
orchestrator and gateway as four containers on one podman network under their Service names, with
the arguments, environment, user, read-only root and /tmp the manifests give them (rendered from
the cpu overlay), waits for each readiness probe as the kubelet would run it, runs `specdec-client`
from a fifth container and checks its greedy tokens against the target alone, checks the gateway
with the `openai` package from this machine, stops each service with SIGTERM and checks that it
exits cleanly within its grace period, reports the image's size, and tears everything down.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = Path(__file__).resolve().parent / "containers.conf"
PUBLIC_PYTHON_IMAGE = "python:3.11-slim-bookworm"
NETWORK = "specdec-image-test"
PROMPT = "def fibonacci(n):"
NEW_TOKENS = 32
ROLES = ("target", "draft", "orchestrator", "gateway")  # the order they start in
READY_TIMEOUT_S = 300.0


def _run(
    command: list[str], check: bool = True, capture: bool = False, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    print("+", shlex.join(command), flush=True)
    return subprocess.run(command, check=check, text=True, capture_output=capture, **kwargs)


def builder() -> str:
    """podman where installed, else docker when its daemon answers; the message says what to install."""
    if shutil.which("podman"):
        os.environ.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
        return "podman"
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return "docker"
    raise SystemExit("image: needs podman (apt-get install podman buildah runc iptables) or a running docker daemon")


@dataclass(frozen=True)
class PipLocations:
    """What the build mounts of this machine's pip configuration."""

    files: list[Path]  # configuration files and the local folders, indexes and constraints they name
    certificates: list[Path]  # CA bundles pip is told to trust (a proxy's CA may be among them)
    index: str | None  # the first local index (file://)

    @property
    def mounts(self) -> list[Path]:
        return sorted({*self.files, *self.certificates})


def pip_locations() -> PipLocations:
    """This machine's pip configuration files and the local paths they name (folders of wheels,
    file:// indexes, constraint files, CA bundles), and the first local index."""
    debug = subprocess.run(
        [sys.executable, "-m", "pip", "config", "debug"], capture_output=True, text=True, check=False
    ).stdout
    files: set[Path] = set()
    certificates: set[Path] = set()
    index = None
    for line in debug.splitlines():
        line = line.strip()
        if line.endswith(", exists: True"):
            files.add(Path(line.removesuffix(", exists: True")))
            continue
        if ":" not in line:
            continue
        key, _, value = line.partition(": ")
        for token in value.strip("'\"").split():
            location = token.removeprefix("file://")
            if not (location.startswith("/") and Path(location).exists()):
                continue
            if key.endswith("cert"):
                certificates.add(Path(location))  # mounted over the image's own bundle for RUN steps only
            elif token.startswith("file://"):
                files.add(Path(location).parent)  # an index's pages link to files beside it
                if "index-url" in key and index is None:
                    index = token
            else:
                files.add(Path(location))
    return PipLocations(sorted(files), sorted(certificates), index)


def build(variant: str, tag: str, python_image: str, torch_index: str | None = None) -> None:
    tool = builder()
    command = [tool, "build", "-f", str(ROOT / "deploy" / "Dockerfile"), "-t", tag]
    command += ["--build-arg", f"VARIANT={variant}", "--build-arg", f"PYTHON_IMAGE={python_image}"]
    if tool == "podman":
        pip = pip_locations()
        command += ["--network", "host"] + [f"--volume={p}:{p}:ro" for p in pip.mounts]
        torch_index = torch_index or pip.index
    if torch_index:
        command += ["--build-arg", f"TORCH_CPU_INDEX={torch_index}"]
    started = time.perf_counter()
    _run([*command, str(ROOT)])
    print(f"built {tag} in {time.perf_counter() - started:.0f} s; {image_size_mb(tool, tag):.0f} MB")


def image_size_mb(tool: str, tag: str) -> float:
    size = _run([tool, "image", "inspect", "--format", "{{.Size}}", tag], capture=True).stdout.strip()
    return int(size) / 1e6


# --- the manifests, as podman arguments ------------------------------------------------------------


@dataclass
class Container:
    """One Deployment's container, as `podman run` takes it."""

    role: str
    name: str  # the Service name other containers reach it by
    args: list[str]
    env: dict[str, str]
    user: str
    read_only: bool
    tmpfs: list[str]
    ports: dict[str, int]  # port name -> container port
    probes: dict[str, dict[str, Any]]
    grace_s: int
    published: dict[int, int] = field(default_factory=dict)  # container port -> host port

    def run_arguments(self, image: str) -> list[str]:
        command = ["run", "-d", "--name", self.name, "--network", NETWORK, "--user", self.user]
        if self.read_only:
            command.append("--read-only")
        for path in self.tmpfs:
            command += ["--tmpfs", f"{path}:rw,mode=1777"]
        for key, value in sorted(self.env.items()):
            command += ["--env", f"{key}={value}"]
        for port in self.ports.values():
            command += ["--publish", f"127.0.0.1::{port}"]
        return [*command, image, *self.args]


def render_overlay(overlay: str = "cpu") -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if not kubectl:
        raise SystemExit("image: needs kubectl to render the manifests (make setup installs it)")
    output = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy" / "k8s" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(output) if doc]


def containers_from_manifests(objects: list[dict[str, Any]]) -> dict[str, Container]:
    """Each Deployment's container with what its manifest passes: args, environment (ConfigMap keys
    resolved), user, read-only root, emptyDir mounts, ports, probes and grace period."""
    config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
    found: dict[str, Container] = {}
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        role = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = {}
        for variable in container.get("env", []):
            if "value" in variable:
                env[variable["name"]] = str(variable["value"])
            else:
                ref = variable["valueFrom"]["configMapKeyRef"]
                env[variable["name"]] = str(config_maps[ref["name"]][ref["key"]])
        security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
        empty_dirs = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
        mounts = [m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in empty_dirs]
        found[role] = Container(
            role=role,
            name=deployment["metadata"]["name"],
            args=list(container.get("args", [])),
            env=env,
            user=f"{security['runAsUser']}:{security.get('runAsGroup', security['runAsUser'])}",
            read_only=bool(security.get("readOnlyRootFilesystem")),
            tmpfs=mounts,
            ports={p["name"]: p["containerPort"] for p in container.get("ports", [])},
            probes={k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container},
            grace_s=int(pod.get("terminationGracePeriodSeconds", 30)),
        )
    return found


# --- the run ---------------------------------------------------------------------------------------


def _probe_passes(container: Container, probe: dict[str, Any]) -> bool:
    """The probe as the kubelet runs it, against the container's published port."""
    if "grpc" in probe:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        port = container.published[probe["grpc"]["port"]]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.RpcError:
                return False
            return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)
    import httpx2 as httpx

    get = probe["httpGet"]
    port = get["port"] if isinstance(get["port"], int) else container.ports[get["port"]]
    try:
        return httpx.get(f"http://127.0.0.1:{container.published[port]}{get['path']}", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _published(tool: str, container: Container) -> dict[int, int]:
    ports = {}
    for port in container.ports.values():
        line = _run([tool, "port", container.name, f"{port}/tcp"], capture=True).stdout.strip().splitlines()[0]
        ports[port] = int(line.rsplit(":", 1)[1])
    return ports


def _target_alone_tokens() -> list[int]:
    """The default pair's target decoding alone, greedy, on this machine: what `make run` checks against."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ROOT / "default_models" / "pair" / "target"
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        output = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones(1, len(ids))
        )
    return [int(t) for t in output[0, len(ids) :]]


_USER_AND_ROOT = """
import os, pathlib
assert os.getuid() == 10001, f"runs as uid {os.getuid()}, not 10001"
pathlib.Path("/tmp/probe").write_text("x")
for path in ("/probe", "/opt/specdec/probe", "/usr/local/lib/probe", os.path.expanduser("~/probe")):
    try:
        pathlib.Path(path).write_text("x")
    except OSError:
        continue
    raise SystemExit(f"{path} is writable")
print("uid 10001; the root is read-only and /tmp writable")
"""
# podman leaves the build's mount points behind, empty: none of their contents may be in a layer.
_NO_BUILD_FILES = """
import os, sys
full = []
for top in sys.argv[1:]:
    for folder, _, files in os.walk(top):
        full += [os.path.join(folder, f) for f in files if os.path.getsize(os.path.join(folder, f))]
    if os.path.isfile(top) and os.path.getsize(top):
        full.append(top)
assert not full, f"files of the build's pip configuration or indexes in the image: {full[:5]}"
print("no file of the build's pip configuration or local indexes in the image")
"""


def _check_user_and_root(tool: str, image: str) -> None:
    _run([tool, "run", "--rm", "--read-only", "--tmpfs", "/tmp:rw,mode=1777", "--entrypoint", "python", image,
          "-c", _USER_AND_ROOT])  # fmt: skip
    # The CA bundle's path is the image's own file too, so it is not among those checked.
    _run([tool, "run", "--rm", "--user", "0", "--entrypoint", "python", image, "-c", _NO_BUILD_FILES,
          *map(str, pip_locations().files)])  # fmt: skip


@contextmanager
def _network(tool: str) -> Iterator[None]:
    _run([tool, "network", "rm", "-f", NETWORK], check=False, capture=True)
    _run([tool, "network", "create", NETWORK], capture=True)
    try:
        yield
    finally:
        _run([tool, "network", "rm", "-f", NETWORK], check=False, capture=True)


def test(tag: str, python_image: str) -> None:
    started = time.perf_counter()
    build("cpu", tag, python_image)
    tool = builder()
    _check_user_and_root(tool, tag)
    containers = containers_from_manifests(render_overlay("cpu"))
    expected = _target_alone_tokens()
    for container in containers.values():
        _run([tool, "rm", "-f", container.name], check=False, capture=True)
    with _network(tool):
        try:
            for role in ROLES:
                container = containers[role]
                _run([tool, *container.run_arguments(tag)], capture=True)
                container.published = _published(tool, container)
                deadline = time.monotonic() + READY_TIMEOUT_S
                while not _probe_passes(container, container.probes["readinessProbe"]):
                    state = _run([tool, "inspect", "--format", "{{.State.Status}}", container.name], capture=True)
                    if state.stdout.strip() != "running" or time.monotonic() > deadline:
                        _run([tool, "logs", "--tail", "40", container.name], check=False)
                        raise SystemExit(f"image-test: {container.name} did not become ready")
                    time.sleep(1)
                for kind, probe in container.probes.items():
                    assert _probe_passes(container, probe), (container.name, kind)
                print(f"{container.name}: ready; its probes pass", flush=True)
            client = _run(
                [tool, "run", "--rm", "--network", NETWORK, "--read-only", "--tmpfs", "/tmp:rw,mode=1777", tag,
                 "tools.client", "--server", f"{containers['orchestrator'].name}:50050", "--prompt", PROMPT,
                 "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0", "--json"],
                capture=True,
            )  # fmt: skip
            result = json.loads(client.stdout.strip().splitlines()[-1])
            assert result["token_ids"] == expected, (result["token_ids"], expected)
            print(f"specdec-client in a container: {len(expected)} greedy tokens, identical to the target alone")
            _check_gateway(containers["gateway"], result["text"])
            for role in reversed(ROLES):
                _stop_cleanly(tool, containers[role])
        finally:
            for container in containers.values():
                _run([tool, "rm", "-f", container.name], check=False, capture=True)
    size = image_size_mb(tool, tag)
    print(f"image {tag}: {size:.0f} MB")
    _run([tool, "run", "--rm", "--entrypoint", "sh", tag, "-c",
          "du -sm /usr/local/lib/python3.11/site-packages/* | sort -n | tail -6"])  # fmt: skip
    print(f"make image-test passed in {time.perf_counter() - started:.0f} s")


def _check_gateway(gateway: Container, text: str) -> None:
    import openai

    port = gateway.published[gateway.ports["http"]]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert response.choices[0].text == text, (response.choices[0].text, text)
    print("the gateway container through the openai package: the same text")


def _stop_cleanly(tool: str, container: Container) -> None:
    """SIGTERM, as Kubernetes sends it; the service must exit 0 within its grace period."""
    started = time.perf_counter()
    _run([tool, "stop", "--time", str(container.grace_s), container.name], capture=True)
    seconds = time.perf_counter() - started
    code = _run([tool, "inspect", "--format", "{{.State.ExitCode}}", container.name], capture=True).stdout.strip()
    assert code == "0" and seconds < container.grace_s, (container.name, code, seconds)
    print(f"{container.name}: SIGTERM -> exit 0 in {seconds:.1f} s (grace {container.grace_s} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="image", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["build", "test"])
    parser.add_argument("--variant", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tag", default="")
    parser.add_argument("--python-image", default=PUBLIC_PYTHON_IMAGE, help="the base (default: the public one)")
    parser.add_argument("--torch-index", default=None, help="the CPU build's torch index (default: the Dockerfile's)")
    args = parser.parse_args(argv)
    tag = args.tag or f"specdec:{args.variant}"
    if args.command == "build":
        build(args.variant, tag, args.python_image, args.torch_index)
    else:
        test(args.tag or "specdec:cpu", args.python_image)
    return 0


if __name__ == "__main__":
    sys.exit(main())
