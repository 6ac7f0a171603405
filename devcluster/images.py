"""Images for the real-node cluster, built with buildah on this machine (there is no registry to pull from)
and kept as OCI archives that every node's containerd imports.

    pause      k8s.gcr.io/pause:3.2                          devcluster/pause.c, static, FROM scratch
    python     docker.io/library/python:3.11-slim-bookworm   Debian 12 minbase + python3 (debootstrap), the
                                                             Dockerfile's default base, under its name
    torch      docker.io/sgdjob/devcluster-torch:2.13.0      python + the CPU torch wheel (TRAINER_BASE)
    operator   docker.io/sgdjob/operator:dev                 Dockerfile --target operator
    trainer    docker.io/sgdjob/trainer:dev                  Dockerfile --target trainer (FROM torch)
    charlm     docker.io/sgdjob/charlm-trainer:dev           examples/custom-task/Dockerfile (FROM trainer):
                                                             a user's own training code in an image

Each image has a key: a hash of what it is made from (its recipe, the Dockerfile and every file the
Dockerfile COPYs, the key of its base). An archive whose key file matches is used as it is, so
unchanged sources never rebuild. Builds run at normal CPU priority and the lowest best-effort I/O
priority: the real-node tests wait for them, and under `make test` the other tests run beside them, so
a nice-19 build there starved (CI: the cluster's start passed pytest's 600-s limit). RUN steps use the host's network
(pip) with the host's CA bundle; never buildah's default network, which would add a bridge and
iptables rules to the host.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("devcluster.images")
ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
LOW_IO = ["ionice", "-c2", "-n7"]
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BUILD_PACKAGES = ("buildah", "debootstrap", "runc", "gcc", "libc6-dev")
PY_PACKAGES = ("python3", "python3-venv", "python3-pip", "python-is-python3", "ca-certificates", "procps", "iproute2")
SUITE = "bookworm"
REFS = {
    "pause": "k8s.gcr.io/pause:3.2",
    "python": "docker.io/library/python:3.11-slim-bookworm",
    "torch": "docker.io/sgdjob/devcluster-torch:2.13.0",
    "operator": "docker.io/sgdjob/operator:dev",
    "trainer": "docker.io/sgdjob/trainer:dev",
    "charlm": "docker.io/sgdjob/charlm-trainer:dev",
}
EXAMPLES = {"charlm": ROOT / "examples" / "custom-task"}  # image name -> the example folder (its build context)
SKIP_NAMES = ("__pycache__", ".pyc", ".egg-info")  # as in .dockerignore: not part of any image


def default_cache() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "sgdjob-devcluster" / "images"


@dataclass(frozen=True)
class Image:
    name: str
    ref: str  # as a pod spec's image resolves (sgdjob/trainer:dev -> docker.io/sgdjob/trainer:dev)
    archive: Path
    key: str


def archive_digest(archive: Path) -> str:
    """The manifest digest recorded in an OCI archive's index (what containerd lists for the image)."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        if member is None:
            raise ValueError(f"{archive} has no index.json")
        return str(json.load(member)["manifests"][0]["digest"])


def import_image(sock: Path, image: Image) -> bool:
    """Import into the containerd at `sock` unless it has this archive's image already; True if imported."""
    ctr = ["ctr", "--address", str(sock), "-n", "k8s.io"]
    listing = subprocess.run([*ctr, "images", "ls"], capture_output=True, text=True, check=True).stdout
    have = {tuple(line.split()[:3:2]) for line in listing.splitlines()[1:] if line.strip()}
    if (image.ref, archive_digest(image.archive)) in have:
        return False
    argv = [*LOW_IO, *ctr, "images", "import", "--all-platforms"]
    subprocess.run([*argv, str(image.archive)], capture_output=True, check=True)
    return True


def _run(argv: list[str], **kwargs: object) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])}... failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return str(result.stdout)


def _hash(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def context_files(dockerfile: Path, context: Path) -> list[Path]:
    """Every file the Dockerfile COPYs from the build context (not `COPY --from=`), sorted."""
    files: set[Path] = set()
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if not words or words[0].upper() != "COPY" or any(w.startswith("--from") for w in words):
            continue
        for src in (w for w in words[1:-1] if not w.startswith("--")):
            path = context / src
            found = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
            files.update(p for p in found if not any(s in str(p.relative_to(context)) for s in SKIP_NAMES))
    return sorted(files)


def source_key(target: str, base_key: str, context: Path) -> str:
    """A Dockerfile target's cache key: its base's key, the Dockerfile, and each file it COPYs (path,
    content, executable bit). Anything else in the checkout (tests, docs, caches) never rebuilds it."""
    dockerfile = context / "Dockerfile"
    parts: list[str | bytes] = [f"{target}-v1", base_key, dockerfile.read_bytes()]
    for f in context_files(dockerfile, context):
        parts += [str(f.relative_to(context)), f.read_bytes(), oct(f.stat().st_mode & 0o111)]
    return _hash(*parts)


@dataclass
class ImageBuilder:
    """Builds (or finds in the cache) the images above; `timings` says what each cost."""

    cache: Path = field(default_factory=default_cache)
    context: Path = ROOT
    rebuild: bool = False
    timings: dict[str, float] = field(default_factory=dict)

    def ensure_packages(self) -> None:
        missing = [p for p in BUILD_PACKAGES if not _dpkg_installed(p)]
        if missing:
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            cmd = ["nice", "-n", "19", "apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]
            if subprocess.run(cmd, env=env, capture_output=True, check=False).returncode != 0:
                subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, check=False)
                _run(cmd, env=env)

    def _ensure(self, name: str, key: str, build: Callable[[], None], in_buildah: bool = False) -> Image:
        self.cache.mkdir(parents=True, exist_ok=True)
        img = Image(name, REFS[name], self.cache / f"{name}.tar", key)
        keyfile = self.cache / f"{name}.key"
        t0 = time.monotonic()
        cached = img.archive.is_file() and keyfile.is_file() and keyfile.read_text().strip() == key
        if cached and not self.rebuild:
            if in_buildah:  # a base for later builds
                _restore(img)
            self.timings[name] = round(time.monotonic() - t0, 2)
            log.info("image %s: cached (%s)", name, key)
            return img
        log.info("image %s: building (%s)", name, key)
        self.ensure_packages()
        build()
        tmp = img.archive.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        # Uncompressed layers: no gzip on the way out, nor in each node's import (2 cores).
        _run([*LOW_IO, "buildah", "push", "-q", "--disable-compression", img.ref, f"oci-archive:{tmp}:{img.ref}"])
        tmp.replace(img.archive)
        keyfile.write_text(key + "\n")
        self.timings[name] = round(time.monotonic() - t0, 2)
        log.info("image %s: built in %.1f s", name, self.timings[name])
        return img

    # --- the images ---
    def pause(self) -> Image:
        source = HERE / "pause.c"

        def build() -> None:
            with tempfile.TemporaryDirectory() as tmp:
                _run([*LOW_IO, "gcc", "-Os", "-static", "-o", f"{tmp}/pause", str(source)])
                ctr = _run(["buildah", "from", "scratch"]).strip()
                _run(["buildah", "copy", ctr, f"{tmp}/pause", "/pause"])
            _run(["buildah", "config", "--entrypoint", '["/pause"]', "--user", "65535:65535", ctr])
            _run(["buildah", "commit", "-q", "--rm", ctr, REFS["pause"]])

        return self._ensure("pause", _hash("pause-v1", source.read_bytes()), build)

    def python(self) -> Image:
        """Debian's python3 3.11 as the Dockerfile's `python:3.11-slim-bookworm` (pip installs go to
        /usr/local, as in the official image: Debian's externally-managed marker is removed)."""
        key = _hash("python-v1", SUITE, *PY_PACKAGES)
        return self._ensure("python", key, lambda: self._build_python(key), in_buildah=True)

    def _build_python(self, key: str) -> None:
        root = self.cache / f"rootfs-python-{key}"
        if not (root / ".complete").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            _run(
                [*LOW_IO, "debootstrap", "--variant=minbase", f"--include={','.join(PY_PACKAGES)}", SUITE, str(root),
                 _apt_mirror()]
            )  # fmt: skip
            for pattern in ("var/lib/apt/lists/*", "var/cache/apt/*.bin", "var/cache/apt/archives/*.deb",
                            "usr/share/doc/*", "usr/share/man/*", "usr/share/locale/*",
                            "usr/lib/python3*/EXTERNALLY-MANAGED", "etc/apt/sources.list"):  # fmt: skip
                for p in root.glob(pattern):
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            (root / "etc" / "resolv.conf").write_text("")
            (root / ".complete").touch()
        with tempfile.NamedTemporaryFile(dir=self.cache, suffix=".tar") as tar:
            _run([*LOW_IO, "tar", "--numeric-owner", "-C", str(root), "-cf", tar.name, "--exclude=./.complete",
                  "--exclude=./dev/*", "--exclude=./proc/*", "--exclude=./sys/*", "."])  # fmt: skip
            ctr = _run(["buildah", "from", "scratch"]).strip()
            _run([*LOW_IO, "buildah", "add", ctr, tar.name, "/"])
        path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        _run(["buildah", "config", "--env", f"PATH={path}", "--env", "LANG=C.UTF-8", "--cmd", '["python3"]', ctr])
        _run(["buildah", "commit", "-q", "--rm", ctr, REFS["python"]])

    def torch(self) -> Image:
        """The python image plus the CPU torch wheel pip finds on this machine (pip's own configuration
        points at the local wheel), its dependencies from PyPI."""
        base = self.python()
        spec = os.environ.get("SGDJOB_TORCH", "torch==2.13.0")
        wheels = self.cache / "wheels"
        key = _hash("torch-v1", base.key, spec)

        def build() -> None:
            wheels.mkdir(exist_ok=True)
            _run([*LOW_IO, sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                  "--python-version", "3.11", "-d", str(wheels), spec])  # fmt: skip
            wheel = sorted(wheels.glob(f"{spec.split('==')[0]}-*.whl"))[-1].name
            ctr = _run(["buildah", "from", "--pull=never", base.ref]).strip()
            _run([*LOW_IO, "buildah", "run", "--network=host", "-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro",
                  "-v", f"{wheels}:/wheels:ro", ctr, "--", "pip", "install", "-q", "--no-cache-dir",
                  f"/wheels/{wheel}"])  # fmt: skip
            _run(["buildah", "commit", "-q", "--rm", ctr, REFS["torch"]])

        return self._ensure("torch", key, build, in_buildah=True)

    def project(self, target: str) -> Image:
        """`--target operator` or `--target trainer` of the project's Dockerfile."""
        base = self.torch() if target == "trainer" else self.python()
        dockerfile = self.context / "Dockerfile"
        args = {"PYTHON_BASE": REFS["python"], "TRAINER_BASE": REFS["torch"]}

        def build() -> None:
            argv = [*LOW_IO, "buildah", "bud", "--layers", "--pull=never", "--network=host",
                    "-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro", "--target", target, "-t", REFS[target],
                    "-f", str(dockerfile)]  # fmt: skip
            for k, v in args.items():
                argv += ["--build-arg", f"{k}={v}"]
            _run([*argv, str(self.context)])

        return self._ensure(target, source_key(target, base.key, self.context), build)

    def example(self, name: str) -> Image:
        """An example's own image, as its README builds it: its Dockerfile FROM the trainer image."""
        base = self.project("trainer")
        context = EXAMPLES[name]

        def build() -> None:
            _restore(base)  # the trainer may have come from the archive cache
            _run([*LOW_IO, "buildah", "bud", "--layers", "--pull=never", "--network=none",
                  "--build-arg", f"TRAINER_IMAGE={base.ref}", "-t", REFS[name], str(context)])  # fmt: skip

        return self._ensure(name, source_key(name, base.key, context), build)

    def get(self, name: str) -> Image:
        if name in ("operator", "trainer"):
            return self.project(name)
        if name in EXAMPLES:
            return self.example(name)
        return {"pause": self.pause, "python": self.python, "torch": self.torch}[name]()


def _dpkg_installed(package: str) -> bool:
    result = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True, check=False)
    return "install ok installed" in result.stdout


def _restore(img: Image) -> None:
    """Put an image into buildah's storage from its archive (a base to build on), unless it is there."""
    if not _buildah_has(img.ref):
        image_id = _run(["buildah", "pull", "-q", f"oci-archive:{img.archive}"]).split()[-1]
        _run(["buildah", "tag", image_id, img.ref])


def _buildah_has(ref: str) -> bool:
    return (
        subprocess.run(["buildah", "inspect", "--type", "image", ref], capture_output=True, check=False).returncode == 0
    )


def _apt_mirror() -> str:
    """The Debian mirror this machine's apt uses for the suite (deb822 .sources first, then sources.list)."""
    for src in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for stanza in src.read_text().split("\n\n"):
            fields = dict(
                line.split(":", 1) for line in stanza.splitlines() if ":" in line and not line.startswith("#")
            )
            uris, suites = fields.get("URIs", "").split(), fields.get("Suites", "").split()
            if uris and SUITE in suites and "deb" in fields.get("Types", "").split():
                return uris[0]
    for line in (
        Path("/etc/apt/sources.list").read_text().splitlines() if Path("/etc/apt/sources.list").exists() else []
    ):
        words = line.split()
        if len(words) >= 3 and words[0] == "deb" and words[2] == SUITE:
            return words[1]
    raise RuntimeError(f"no Debian {SUITE} source in /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list")
