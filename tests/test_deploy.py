"""deploy/ can never drift from the CLI: every command line in it is parsed by the real
parser (`--dry-run`) with the environment its engine would give, and the manifests are
checked for the wiring that a typo would break.

- Docker: Dockerfiles parsed instruction by instruction (non-root USER, PYTHONUNBUFFERED,
  HEALTHCHECK, ENTRYPOINT + CMD is a valid psar command); the health probe is run against
  a real shard.
- Kubernetes: the kustomization rendered for every value of its knob (kubectl kustomize
  when installed, else a small renderer for the features used here), objects validated
  against the Kubernetes JSON schemas when `kubernetes-validate` is installed, and
  structurally always (names, selectors, headless Services, gRPC probes, volumes, scrape
  annotations, PodMonitor match, worker counts); each container's command is expanded
  like the kubelet does ($(VAR) from env and envFrom) and dry-run per pod index.
- Slurm: tests/test_deploy_slurm.py (fake Slurm commands, every run) and
  tests/test_slurm.py (a real Slurm, slow).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import yaml

from psar.trainkit import roles
from psar.worker import cli

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKER = DEPLOY / "docker"
SLURM = DEPLOY / "slurm"
KNOBS = ("ps", "allreduce", "allreduce-torchrun")
ROLE_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PSAR_RANK",
            "PSAR_WORLD_SIZE", "PSAR_SERVERS", "PSAR_SHARD", "SLURM_PROCID", "SLURM_NTASKS",
            "SLURM_LOCALID", "JOB_COMPLETION_INDEX", "HOSTNAME")  # fmt: skip

# Files and commands each extractor saw, for the "nothing was skipped" test at the end.
COVERED: set[Path] = set()


# --------------------------------------------------------------------------- dry runs


def dry_run(argv: list[str], env: dict[str, str]) -> dict:
    """`psar <argv> --dry-run` in-process with exactly `env` as the launcher's variables;
    returns the resolved config. Fails the test with psar's own message on a bad line."""
    assert argv and argv[0] in ("server", "train"), f"not a psar server/train line: {argv}"
    base = {k: v for k, v in os.environ.items() if k not in ROLE_ENV}
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, {**base, **env}, clear=True),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            rc = cli.main([argv[0], "--dry-run", *argv[1:]])
        except SystemExit as e:
            rc = e.code
        if rc == 0 and argv[0] == "train":
            # What the worker will resolve at start (flags first, then this env).
            cfg = json.loads(out.getvalue())
            ps = cfg["arch"] == "ps"
            rank = roles.resolve_rank(cfg["ps"]["rank"] if ps else -1, os.environ)
            world = roles.resolve_world_size(cfg["ps"]["world_size"] if ps else 0, os.environ)
            cfg["_resolved"] = {"rank": rank, "world_size": world,
                                "local_rank": roles.resolve_local_rank(os.environ),
                                "servers": os.environ.get("PSAR_SERVERS", "")}  # fmt: skip
            return cfg
    assert rc == 0, f"psar {shlex.join(argv)} rejected (env {env}):\n{err.getvalue()}"
    return json.loads(out.getvalue())


def run_line(argv: list[str], env: dict[str, str]) -> dict:
    """Dry-run a `psar ...` or `torchrun ... psar ...` command line as its engine starts it.

    torchrun's part goes through torch.distributed.run's own parser; the psar part is then
    dry-run as torchrun's first and last rank would see it."""
    if argv[0] == "psar":
        return dry_run(argv[1:], env)
    assert argv[0] == "torchrun", f"a command that is neither psar nor torchrun: {argv}"
    from torch.distributed.run import get_args_parser

    try:
        args = get_args_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"torchrun rejects: {shlex.join(argv)}")
    if args.no_python:
        assert args.training_script == "psar", argv
    else:
        assert args.module and args.training_script == "psar.worker.cli", argv
    assert args.rdzv_backend in ("c10d", "static"), args.rdzv_backend
    nnodes = int(str(args.nnodes).split(":")[-1])
    nproc = int(args.nproc_per_node)
    world = nnodes * nproc
    host, _, port = (args.rdzv_endpoint or "").rpartition(":")
    assert host and port.isdigit(), f"--rdzv-endpoint HOST:PORT, got {args.rdzv_endpoint!r}"
    cfg = {}
    for rank in sorted({0, world - 1}):
        torch_env = {**env, "RANK": str(rank), "WORLD_SIZE": str(world),
                     "LOCAL_RANK": str(rank % nproc), "MASTER_ADDR": host,
                     "MASTER_PORT": "29500"}  # fmt: skip
        cfg = dry_run(list(args.training_script_args), torch_env)
        assert cfg["_resolved"]["rank"] == rank and cfg["_resolved"]["world_size"] == world
    cfg["_torchrun"] = {"nnodes": nnodes, "nproc": nproc, "endpoint": args.rdzv_endpoint,
                        "local_addr": args.local_addr}  # fmt: skip
    return cfg


# --------------------------------------------------------------------------- Docker


def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuations joined, comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker drops comment lines, also inside a continuation
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        full = buf + line
        buf = ""
        instr, _, rest = full.partition(" ")
        out.append((instr.upper(), rest.strip()))
    assert not buf, f"{path}: dangling line continuation"
    return out


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(a, str) for a in value), args
    return value


def docker_env(instrs: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for instr, args in instrs:
        if instr == "ENV":
            for tok in shlex.split(args):
                key, sep, val = tok.partition("=")
                assert sep, f"ENV {args}: use KEY=value"
                env[key] = val
    return env


def docker_args(instrs: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for instr, args in instrs:
        if instr == "ARG":
            key, _, val = args.partition("=")
            out[key] = val
    return out


DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile.*") if p.suffix != ".dockerignore")


def test_both_images_exist() -> None:
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.cpu", "Dockerfile.cuda"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile(path: Path) -> None:
    COVERED.add(path)
    instrs = dockerfile(path)
    names = [i for i, _ in instrs]
    known = {"FROM", "ARG", "ENV", "RUN", "WORKDIR", "COPY", "USER", "EXPOSE", "HEALTHCHECK",
             "ENTRYPOINT", "CMD", "LABEL"}  # fmt: skip
    assert set(names) <= known, set(names) - known
    assert names.count("FROM") == 1
    args = docker_args(instrs)
    base = dict(instrs)["FROM"]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    env = docker_env(instrs)
    assert env.get("PYTHONUNBUFFERED") == "1"

    # torch: the tested version CI installs (pyproject accepts a range around it); the
    # CPU image from the CPU index.
    pin = re.search(r"torch==([0-9][^\s\"']*)", (ROOT / ".ci/run").read_text()).group(1)
    assert args["TORCH_VERSION"] == pin
    low, high = re.search(
        r'"torch>=([^,]+),<([^"]+)"', (ROOT / "pyproject.toml").read_text()
    ).groups()
    as_tuple = lambda v: tuple(int(x) for x in v.split(".")[:2])  # noqa: E731
    assert as_tuple(low) <= as_tuple(pin) < as_tuple(high), (low, pin, high)
    if path.name == "Dockerfile.cpu":
        assert base == "python:3.11-slim"
        assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    else:
        assert base.startswith(("nvidia/cuda:", "pytorch/pytorch:")), base
        assert "runtime" in base or "devel" in base, base
    runs = " ".join(a for i, a in instrs if i == "RUN")
    assert '"torch==${TORCH_VERSION}"' in runs and "--index-url" in runs
    assert "pip install ." in runs

    # Non-root, numerically (so Kubernetes' runAsNonRoot can check it), created here.
    users = [a for i, a in instrs if i == "USER"]
    assert users, "no USER: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert f"--uid {uid}" in runs
    # After USER nothing may need root any more.
    assert "RUN" not in names[names.index("USER") :]

    # Every COPY source exists and passes the BuildKit per-Dockerfile ignore file.
    ignore = (path.parent / f"{path.name}.dockerignore").read_text()
    allowed = [ln[1:].rstrip("/") for ln in ignore.splitlines() if ln.startswith("!")]
    for instr, a in instrs:
        if instr == "COPY":
            *srcs, _dest = shlex.split(a)
            for src in srcs:
                assert (ROOT / src).exists(), f"COPY {src}: no such path"
                assert any(src.rstrip("/") == p or src.startswith(p + "/") for p in allowed), (
                    f"COPY {src} is excluded by {path.name}.dockerignore"
                )

    # HEALTHCHECK runs the probe this image copies in.
    hc = dict(instrs)["HEALTHCHECK"]
    assert "--interval=" in hc and "--timeout=" in hc
    probe = exec_form(hc[hc.index("CMD") + 3 :].strip())
    assert probe[0] == "python" and probe[1] == "/usr/local/bin/psar-healthcheck"
    assert "deploy/docker/healthcheck.py /usr/local/bin/psar-healthcheck" in " ".join(
        a for i, a in instrs if i == "COPY"
    )

    # ENTRYPOINT + CMD is a psar command the CLI accepts.
    entry = exec_form(dict(instrs)["ENTRYPOINT"])
    cmd = exec_form(dict(instrs)["CMD"])
    argv = entry + cmd
    if argv[:2] == ["tini", "--"]:
        assert "tini" in runs
        argv = argv[2:]
    assert argv[0] == "psar", argv
    cfg = run_line(argv, {})
    exposed = {int(p) for i, a in instrs if i == "EXPOSE" for p in a.split()}
    assert {50051, 9400} <= exposed
    if argv[1] == "server":
        assert cfg["bind"].startswith("0.0.0.0:") and int(cfg["bind"].rpartition(":")[2]) in exposed
    if cfg.get("metrics_port"):
        assert cfg["metrics_addr"] == "0.0.0.0" and cfg["metrics_port"] in exposed


def test_dockerignore_files_agree() -> None:
    files = sorted(DOCKER.glob("*.dockerignore"))
    assert [p.name for p in files] == [
        "Dockerfile.cpu.dockerignore",
        "Dockerfile.cuda.dockerignore",
    ]
    assert files[0].read_text() == files[1].read_text()


def _healthcheck():
    sys.path.insert(0, str(DOCKER))
    try:
        import healthcheck
    finally:
        sys.path.remove(str(DOCKER))
    return healthcheck


def test_healthcheck_probe_against_real_servers(tmp_path) -> None:
    """The Docker probe: healthy on a live shard, and on a bare gRPC server without a
    health service (UNIMPLEMENTED); unhealthy when nothing listens."""
    from concurrent import futures

    import grpc

    from psar.ps.server.config import ServerConfig
    from psar.ps.server.serve import start_server

    hc = _healthcheck()
    server, port, _ = start_server(ServerConfig(bind="127.0.0.1:0"))
    bare = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    bare_port = bare.add_insecure_port("127.0.0.1:0")
    bare.start()
    try:
        assert hc.main([f"127.0.0.1:{port}"]) == 0
        ok, why = hc.check(f"127.0.0.1:{bare_port}")
        assert ok and "no health service" in why
    finally:
        server.stop(0)
        bare.stop(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    ok, why = hc.check(f"127.0.0.1:{closed}", timeout=0.5)
    assert not ok and "no gRPC server" in why


def test_healthcheck_finds_the_shard_in_proc(tmp_path) -> None:
    hc = _healthcheck()
    for pid, argv in {1: ["tini", "--", "psar", "server", "--bind", "0.0.0.0:50061"],
                      7: ["/usr/local/bin/psar", "server"],
                      9: ["python", "-m", "psar.worker.cli", "server", "--bind=10.1.2.3:7"]}.items():  # fmt: skip
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    assert hc.find_target(str(tmp_path)) == "127.0.0.1:50061"
    (tmp_path / "1" / "cmdline").write_bytes(b"tini\0--\0psar\0train\0--arch\0ps\0")
    assert hc.find_target(str(tmp_path)) == "127.0.0.1:50051"  # pid 7: the default bind
    for pid in ("1", "7", "9"):
        (tmp_path / pid / "cmdline").write_bytes(b"psar\0train\0")
    assert hc.find_target(str(tmp_path)) is None  # a worker container: main() exits 0


# --------------------------------------------------------------------------- Kubernetes


def set_knob(text: str, value: str) -> str:
    new, n = re.subn(r"(?m)^(components:\n  - )\S+$", rf"\g<1>{value}", text)
    assert n == 1, "kustomization.yaml: expected exactly one `components:` entry (the knob)"
    return new


def knob() -> str:
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert len(k["components"]) == 1, "the knob is one component"
    return k["components"][0]


def _render_py(root: Path) -> list[dict]:
    """The subset of kustomize used by deploy/k8s: one component's resources, a
    configMapGenerator of literals (hash suffix off), images."""
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    assert set(k) <= {"apiVersion", "kind", "components", "configMapGenerator",
                      "generatorOptions", "images"}, set(k)  # fmt: skip
    assert k["generatorOptions"]["disableNameSuffixHash"] is True
    objs = []
    for gen in k.get("configMapGenerator", []):
        data = dict(lit.split("=", 1) for lit in gen["literals"])
        meta = {"name": gen["name"], "labels": gen.get("options", {}).get("labels", {})}
        objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    for comp in k["components"]:
        ck = yaml.safe_load((root / comp / "kustomization.yaml").read_text())
        assert ck["kind"] == "Component" and set(ck) == {"apiVersion", "kind", "resources"}
        for res in ck["resources"]:
            objs += [d for d in yaml.safe_load_all((root / comp / res).read_text()) if d]
    images = {i["name"]: f"{i.get('newName', i['name'])}:{i['newTag']}" for i in k["images"]}
    for _, tmpl in pod_templates(objs):
        for c in tmpl["spec"]["containers"]:
            c["image"] = images.get(c["image"], c["image"])
    return objs


def _render_kubectl(root: Path) -> list[dict]:
    p = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return [d for d in yaml.safe_load_all(p.stdout) if d]


def _tree_with_knob(tmp: Path, value: str) -> Path:
    root = tmp / f"k8s-{value}"
    shutil.copytree(K8S, root)
    kfile = root / "kustomization.yaml"
    kfile.write_text(set_knob(kfile.read_text(), value))
    return root


RENDERED: dict[str, list[dict]] = {}


def render(value: str, tmp_path_factory) -> list[dict]:
    """deploy/k8s with the knob set to `value`, rendered (kubectl if present)."""
    if value not in RENDERED:
        root = _tree_with_knob(tmp_path_factory.mktemp("k8s"), value)
        objs = _render_kubectl(root) if shutil.which("kubectl") else _render_py(root)
        RENDERED[value] = objs
        for comp_file in (K8S / value).glob("*.yaml"):
            COVERED.add(comp_file)
        COVERED.add(K8S / "kustomization.yaml")
    return copy.deepcopy(RENDERED[value])


def pod_templates(objs: list[dict]) -> Iterator[tuple[dict, dict]]:
    """(owner object, pod template) for every workload object."""
    for o in objs:
        if o["kind"] in ("StatefulSet", "Deployment", "Job"):
            yield o, o["spec"]["template"]
        elif o["kind"] == "PyTorchJob":
            for spec in o["spec"]["pytorchReplicaSpecs"].values():
                yield o, spec["template"]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """The kubelet's $(VAR) expansion: defined names are replaced, $$ escapes."""

    def one(s: str) -> str:
        return re.sub(
            r"\$\$|\$\((\w+)\)",
            lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
            s,
        )

    return [one(a) for a in argv]


def container_env(objs: list[dict], c: dict, engine: dict[str, str]) -> dict[str, str]:
    """What a container's process sees: the engine's variables, envFrom, then env."""
    maps = {o["metadata"]["name"]: o.get("data", {}) for o in by_kind(objs, "ConfigMap")}
    env = dict(engine)
    for src in c.get("envFrom", []):
        name = src["configMapRef"]["name"]
        assert name in maps, f"envFrom: no ConfigMap {name!r}"
        env.update(maps[name])
    samples = {"status.podIP": "10.0.0.5", "metadata.name": "pod-0"}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in samples, f"env {e['name']}: fieldRef {path} unknown to this test"
            env[e["name"]] = samples[path]
    return env


def engine_envs(owner: dict, tmpl: dict) -> list[dict[str, str]]:
    """The variables Kubernetes (or the training operator) gives the first and last pod."""
    name, kind, spec = owner["metadata"]["name"], owner["kind"], owner["spec"]
    if kind == "StatefulSet":
        return [{"HOSTNAME": f"{name}-{i}"} for i in sorted({0, spec["replicas"] - 1})]
    if kind == "Job":
        assert spec.get("completionMode") == "Indexed", f"Job {name}: use an Indexed Job"
        n = spec["completions"]
        return [{"JOB_COMPLETION_INDEX": str(i), "HOSTNAME": f"{name}-{i}"}
                for i in sorted({0, n - 1})]  # fmt: skip
    assert kind == "PyTorchJob"
    specs = spec["pytorchReplicaSpecs"]
    world = sum(s["replicas"] for s in specs.values())
    first = 0 if specs["Master"]["template"] is tmpl else 1
    common = {"WORLD_SIZE": str(world), "MASTER_ADDR": f"{name}-master-0", "MASTER_PORT": "23456"}
    return [{**common, "RANK": str(first)}]


@pytest.mark.parametrize("value", KNOBS)
def test_knob_renders(value: str, tmp_path_factory) -> None:
    assert knob() in KNOBS, "deploy/k8s/kustomization.yaml: the knob names no component"
    comps = {p.parent.name for p in K8S.glob("*/kustomization.yaml")}
    assert comps == set(KNOBS), comps
    objs = render(value, tmp_path_factory)
    kinds = sorted(o["kind"] for o in objs)
    want = {"ps": ["ConfigMap", "Job", "Service", "StatefulSet"],
            "allreduce": ["ConfigMap", "PyTorchJob"],
            "allreduce-torchrun": ["ConfigMap", "Job", "Service"]}[value]  # fmt: skip
    assert kinds == want


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("value", KNOBS)
def test_python_renderer_matches_kubectl(value: str, tmp_path) -> None:
    """The fallback renderer (used where kubectl is absent) gives kustomize's result."""
    root = _tree_with_knob(tmp_path, value)

    def key(objs: list[dict]) -> list:
        return sorted(json.dumps(o, sort_keys=True) for o in objs)

    assert key(_render_py(root)) == key(_render_kubectl(root))


@pytest.mark.parametrize("value", KNOBS)
def test_k8s_schemas(value: str, tmp_path_factory) -> None:
    """Every object against the Kubernetes OpenAPI schemas (strict: unknown fields fail);
    a PyTorchJob's pod templates as core PodTemplates (its CRD schema is not bundled)."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    objs = render(value, tmp_path_factory)
    checked = []
    for o in objs:
        if o["kind"] == "PyTorchJob":
            for role, spec in o["spec"]["pytorchReplicaSpecs"].items():
                checked.append({"apiVersion": "v1", "kind": "PodTemplate",
                                "metadata": {"name": f"{o['metadata']['name']}-{role}"},
                                "template": spec["template"]})  # fmt: skip
        else:
            checked.append(o)
    errors = []
    for version in ("1.29.0", kv.latest_version()):
        for o in checked:
            try:
                kv.validate(o, version, strict=True)
            except kv.ValidationError as e:  # its repr holds the whole schema: keep it short
                errors.append(f"{o['kind']}/{o['metadata']['name']} @ {version}: {e.message} "
                              f"at /{'/'.join(map(str, e.absolute_path))}")  # fmt: skip
    assert not errors, "\n".join(errors)


def _ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}


@pytest.mark.parametrize("value", KNOBS)
def test_k8s_structure(value: str, tmp_path_factory) -> None:
    objs = render(value, tmp_path_factory)
    names = set()
    for o in objs:
        assert {"apiVersion", "kind", "metadata"} <= set(o)
        meta = o["metadata"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", meta["name"]), meta["name"]
        assert meta.get("labels", {}).get("app.kubernetes.io/part-of") == "psar", meta["name"]
        names.add((o["kind"], meta["name"]))
    assert len(names) == len(objs), "duplicate kind/name"

    podmonitor = yaml.safe_load((DEPLOY / "prometheus" / "podmonitor.yaml").read_text())
    pm_labels = podmonitor["spec"]["selector"]["matchLabels"]
    pm_port = podmonitor["spec"]["podMetricsEndpoints"][0]["port"]
    services = {s["metadata"]["name"]: s for s in by_kind(objs, "Service")}

    for owner, tmpl in pod_templates(objs):
        labels = tmpl["metadata"]["labels"]
        spec = tmpl["spec"]
        where = f"{owner['kind']}/{owner['metadata']['name']}"
        # Prometheus: PodMonitor selects it; the annotation job scrapes the metrics port.
        assert pm_labels.items() <= labels.items(), f"{where}: PodMonitor does not select it"
        ann = tmpl["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        sel = owner["spec"].get("selector", {}).get("matchLabels")
        if sel:
            assert sel.items() <= labels.items(), f"{where}: selector does not match its pods"
        assert spec["securityContext"]["runAsNonRoot"] is True
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            assert c.get("image") and c.get("command"), f"{where}: image and command"
            ports = _ports(c)
            assert ports.get(pm_port) == int(ann["prometheus.io/port"]), f"{where}: {ports}"
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            for m in mounts.values():
                assert m in vols, f"{where}: volumeMount {m} has no volume"
            shm = vols[mounts["/dev/shm"]]
            assert shm["emptyDir"]["medium"] == "Memory", f"{where}: /dev/shm not in memory"
            assert c["resources"]["requests"], where
        if owner["kind"] == "StatefulSet" or spec.get("subdomain"):
            svc = services[owner["spec"].get("serviceName") or spec["subdomain"]]
            assert svc["spec"]["clusterIP"] == "None", "stable DNS names need a headless Service"
            assert svc["spec"]["selector"].items() <= labels.items(), f"{where}: Service selector"
            svc_ports = {p["targetPort"] for p in svc["spec"]["ports"]}
            assert svc_ports <= set(ports), f"{where}: Service targets {svc_ports}, pod has {ports}"
        if owner["kind"] == "StatefulSet":
            (c,) = spec["containers"]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["grpc"]["port"] == _ports(c)["grpc"], f"{where}: {probe}"


def _commands(objs: list[dict]) -> Iterator[tuple[dict, dict, dict, dict[str, str]]]:
    """(owner, pod template, container, env) per container and per first/last pod."""
    for owner, tmpl in pod_templates(objs):
        for c in tmpl["spec"]["containers"]:
            for engine in engine_envs(owner, tmpl):
                yield owner, tmpl, c, container_env(objs, c, engine)


@pytest.mark.parametrize("value", KNOBS)
def test_k8s_command_lines(value: str, tmp_path_factory) -> None:
    """Each container's command, expanded as the kubelet does, is accepted by psar (and
    torchrun) with that pod's environment; counts and addresses agree across objects."""
    objs = render(value, tmp_path_factory)
    sts = {s["metadata"]["name"]: s for s in by_kind(objs, "StatefulSet")}
    seen_arch = set()
    for owner, tmpl, c, env in _commands(objs):
        argv = expand(c["command"] + c.get("args", []), env)
        left = [a for a in argv if re.search(r"\$\(\w+\)", a)]
        assert not left, f"{owner['metadata']['name']}: undefined $(VAR) stays literal: {left}"
        cfg = run_line(argv, env)
        ann_port = int(tmpl["metadata"]["annotations"]["prometheus.io/port"])
        assert cfg["metrics_port"] == ann_port and cfg["metrics_addr"] == "0.0.0.0"
        if argv[1] == "server":
            port = int(cfg["bind"].rpartition(":")[2])
            assert cfg["bind"].startswith("0.0.0.0:") and port == _ports(c)["grpc"]
            # The shard index is the pod's ordinal (HOSTNAME), as the contract says.
            want = int(env["HOSTNAME"].rsplit("-", 1)[1])
            assert roles.resolve_shard(cfg["shard"], env) == want
            continue
        seen_arch.add(cfg["arch"])
        res = cfg["_resolved"]
        if owner["kind"] == "Job" and "_torchrun" not in cfg:
            # Indexed Job: rank = JOB_COMPLETION_INDEX, world = completions.
            assert res["rank"] == int(env["JOB_COMPLETION_INDEX"])
            assert res["world_size"] == owner["spec"]["completions"]
            assert owner["spec"]["parallelism"] == owner["spec"]["completions"]
        if "_torchrun" in cfg:
            tr = cfg["_torchrun"]
            assert tr["nnodes"] == owner["spec"]["completions"] == owner["spec"]["parallelism"]
            host, _, port = tr["endpoint"].rpartition(":")
            assert host == f"{owner['metadata']['name']}-0.{tmpl['spec']['subdomain']}"
            assert int(port) == _ports(c)["rdzv"]
        if cfg["arch"] == "ps":
            # PSAR_SERVERS names every shard pod through the headless Service, in order.
            (shards,) = sts.values()
            svc, n = shards["spec"]["serviceName"], shards["spec"]["replicas"]
            (shard_c,) = shards["spec"]["template"]["spec"]["containers"]
            port = _ports(shard_c)["grpc"]
            want = [f"{shards['metadata']['name']}-{i}.{svc}:{port}" for i in range(n)]
            assert res["servers"].split(",") == want
    want_arch = {"ps": {"ps"}, "allreduce": {"allreduce"}, "allreduce-torchrun": {"allreduce"}}
    assert seen_arch == want_arch[value]


def test_pytorchjob_roles_run_the_same_command(tmp_path_factory) -> None:
    (job,) = by_kind(render("allreduce", tmp_path_factory), "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    cs = [s["template"]["spec"]["containers"] for s in specs.values()]
    assert all(len(c) == 1 and c[0]["name"] == "pytorch" for c in cs)
    assert cs[0][0]["command"] == cs[1][0]["command"]
    assert _ports(cs[0][0])["pytorchjob-port"]


def test_shipped_knob_is_ps() -> None:
    assert knob() == "ps"


# --------------------------------------------------------------------------- coverage


def _mentions_command(path: Path) -> bool:
    for line in path.read_text(errors="replace").splitlines():
        code = line.split("#", 1)[0] if path.suffix in (".yaml", ".yml", ".sbatch", "") else line
        if re.search(r"\bpsar\W+(server|train)\b|\btorchrun\b", code):
            return True
    return False


def test_every_command_line_in_deploy_was_checked(tmp_path_factory) -> None:
    """A new manifest or script with a psar/torchrun command cannot escape the checks."""
    for value in KNOBS:
        render(value, tmp_path_factory)
    COVERED.update(DOCKERFILES)
    COVERED.update(SLURM.glob("*.sbatch"))
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file() and path not in COVERED and path.suffix not in (".json", ".py", ".md"):
            assert not _mentions_command(path), f"{path.relative_to(ROOT)}: not checked here"


def test_docs_cover_the_contract_and_every_file() -> None:
    contract = (ROOT / "docs" / "launch-contract.md").read_text()
    for var in (*roles.RANK_VARS, *roles.WORLD_VARS, *roles.LOCAL_VARS, "PSAR_SHARD",
                "HOSTNAME", "PSAR_SERVERS", "MASTER_ADDR", "MASTER_PORT"):  # fmt: skip
        assert f"`{var}`" in contract, f"docs/launch-contract.md does not name {var}"
    deploy_doc = (ROOT / "docs" / "deploy.md").read_text()
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file() and not path.name.endswith(".dockerignore"):
            rel = path.relative_to(ROOT).as_posix()
            assert rel in deploy_doc or path.parent.relative_to(ROOT).as_posix() + "/" in (
                deploy_doc
            ), f"docs/deploy.md does not mention {rel}"


def test_doc_command_lines_parse() -> None:
    """`psar server|train` lines in the docs' code blocks are accepted too."""
    for doc in ("deploy.md", "launch-contract.md"):
        text = (ROOT / "docs" / doc).read_text()
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                tokens = shlex.split(line, comments=True)
                env = {}
                while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):
                    key, _, val = tokens.pop(0).partition("=")
                    env[key] = val
                if tokens[:1] != ["psar"] or tokens[1:2] not in (["server"], ["train"]):
                    continue
                if any("$" in t for t in tokens):
                    continue  # shell variables: the deploy/ scripts themselves are run above
                run_line(tokens, {"PSAR_SERVERS": "h:1", **env})
