#!/usr/bin/env python3
"""Builds gpuledger's container image as an OCI image layout, without a container engine.

One image holds both binaries (gpuledger-operator, gpuledger-device-plugin) under
/usr/local/bin, with the shared libraries they load (found with ldd: glibc, libm, libgcc_s and
the dynamic loader) at the same paths as on the build machine, an /etc/passwd naming the
non-root user 65532 the image runs as by default, and OCI labels. The device plugin's DaemonSet
runs it as root (it serves a socket in the kubelet's directory); the operator keeps 65532.

The build is reproducible: file order, owners, modes and times are fixed (times from
SOURCE_DATE_EPOCH, default 0), gzip carries no name or time, and JSON is written with sorted
keys, so the same binaries give the same digests.

Output (--out-dir, default target/image):
  layout/                  the OCI image layout (oci-layout, index.json, blobs/sha256/...)
  gpuledger-<tag>.oci.tar  the same layout as one tar (skopeo copy oci-archive:..., podman load)
  digest                   the manifest digest, sha256:...

The image name and tag come from the Helm chart (charts/gpuledger: values.yaml image.repository,
Chart.yaml appVersion); config/ uses the same reference and e2e/tests/image.rs checks that all of
them agree.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile

BINARIES = ("gpuledger-operator", "gpuledger-device-plugin")
NONROOT = 65532
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ImageError(Exception):
    """A problem that stops the build, with what to do about it."""


def chart_reference(repo_root):
    """(repository, tag) from the Helm chart, the one place the image reference is set."""
    values = open(os.path.join(repo_root, "charts/gpuledger/values.yaml"), encoding="utf-8").read()
    chart = open(os.path.join(repo_root, "charts/gpuledger/Chart.yaml"), encoding="utf-8").read()
    repo = re.search(r"^image:\s*\n(?:\s+.*\n)*?\s+repository:\s*(\S+)", values, re.M)
    tag = re.search(r'^appVersion:\s*"?([^"\s]+)"?', chart, re.M)
    if not repo or not tag:
        raise ImageError("charts/gpuledger: cannot read image.repository (values.yaml) or appVersion (Chart.yaml)")
    return repo.group(1), tag.group(1)


def shared_libraries(binary):
    """Absolute paths of the libraries the dynamic loader maps for `binary` (ldd)."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        if "not a dynamic executable" in out.stdout + out.stderr:
            return []
        raise ImageError(f"ldd {binary} failed: {out.stderr.strip()}")
    libs = []
    for line in out.stdout.splitlines():
        line = line.strip()
        if "=> not found" in line:
            raise ImageError(f"{binary} needs a library this machine lacks: {line}")
        m = re.search(r"=>\s*(/\S+)", line) or re.match(r"(/\S+)", line)
        if m:
            libs.append(m.group(1))
    return libs


def add_dir(tar, path, mtime, mode=0o755):
    info = tarfile.TarInfo(path)
    info.type = tarfile.DIRTYPE
    info.mode = mode
    info.mtime = mtime
    tar.addfile(info)


def add_bytes(tar, path, data, mtime, mode=0o644):
    info = tarfile.TarInfo(path)
    info.size = len(data)
    info.mode = mode
    info.mtime = mtime
    tar.addfile(info, io.BytesIO(data))


def root_filesystem(bin_dir, mtime):
    """The layer as an uncompressed tar, entries in a fixed order."""
    files = {}
    for name in BINARIES:
        path = os.path.join(bin_dir, name)
        if not os.path.isfile(path):
            raise ImageError(f"{path} not found: build it first (cargo build --release -p gpuledger-operator -p gpuledger-device-plugin)")
        files[f"usr/local/bin/{name}"] = (open(path, "rb").read(), 0o755)
        for lib in shared_libraries(path):
            # The file itself, at the path the loader asks for (symlinks resolved).
            files[lib.lstrip("/")] = (open(os.path.realpath(lib), "rb").read(), 0o755)
    files["etc/passwd"] = (
        f"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:{NONROOT}:{NONROOT}:nonroot:/home/nonroot:/sbin/nologin\n".encode(),
        0o644,
    )
    files["etc/group"] = (f"root:x:0:\nnonroot:x:{NONROOT}:\n".encode(), 0o644)
    dirs = {"tmp": 0o1777, "home/nonroot": 0o755}
    for path in files:
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.setdefault("/".join(parts[:i]), 0o755)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in sorted(dirs):
            add_dir(tar, d, mtime, dirs[d])
        for path in sorted(files):
            data, mode = files[path]
            add_bytes(tar, path, data, mtime, mode)
    # tarfile writes uid/gid 0 and empty owner names by default; PAX headers carry no times
    # beyond the ones set above.
    return buf.getvalue()


def deterministic_gzip(data):
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=6) as gz:
        gz.write(data)
    return out.getvalue()


def canonical_json(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def sha256(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def write_blob(layout, data):
    digest = sha256(data)
    path = os.path.join(layout, "blobs", "sha256", digest.split(":", 1)[1])
    with open(path, "wb") as f:
        f.write(data)
    return {"digest": digest, "size": len(data)}


def build(bin_dir, out_dir, repository, tag, epoch, revision):
    created = "1970-01-01T00:00:00Z" if epoch == 0 else \
        __import__("datetime").datetime.fromtimestamp(epoch, __import__("datetime").timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    layout = os.path.join(out_dir, "layout")
    if os.path.isdir(layout):
        for root, dirs, names in os.walk(layout, topdown=False):
            for n in names:
                os.remove(os.path.join(root, n))
            for d in dirs:
                os.rmdir(os.path.join(root, d))
    os.makedirs(os.path.join(layout, "blobs", "sha256"), exist_ok=True)

    layer_tar = root_filesystem(bin_dir, epoch)
    layer_gz = deterministic_gzip(layer_tar)
    labels = {
        "org.opencontainers.image.title": "gpuledger",
        "org.opencontainers.image.description": "gpuledger operator and device plugin: a GPU-sharing ledger for Kubernetes",
        "org.opencontainers.image.version": tag,
        "org.opencontainers.image.licenses": "Apache-2.0",
        "org.opencontainers.image.source": "https://github.com/gpuledger/gpuledger",
        "org.opencontainers.image.revision": revision,
        "org.opencontainers.image.created": created,
    }
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": {
            "User": f"{NONROOT}:{NONROOT}",
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"],
            "Entrypoint": ["/usr/local/bin/gpuledger-operator"],
            "Labels": labels,
        },
        "rootfs": {"type": "layers", "diff_ids": [sha256(layer_tar)]},
        "history": [{"created": created, "created_by": "hack/oci-image.py"}],
    }
    config_desc = write_blob(layout, canonical_json(config))
    layer_desc = write_blob(layout, layer_gz)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config_desc},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **layer_desc}],
        "annotations": {k: v for k, v in labels.items() if k != "org.opencontainers.image.description"},
    }
    manifest_desc = write_blob(layout, canonical_json(manifest))
    reference = f"{repository}:{tag}"
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            **manifest_desc,
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {
                "org.opencontainers.image.ref.name": tag,
                "io.containerd.image.name": reference,
            },
        }],
    }
    with open(os.path.join(layout, "index.json"), "wb") as f:
        f.write(canonical_json(index))
    with open(os.path.join(layout, "oci-layout"), "wb") as f:
        f.write(canonical_json({"imageLayoutVersion": "1.0.0"}))

    archive = os.path.join(out_dir, f"gpuledger-{tag}.oci.tar")
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, names in os.walk(layout):
            dirs.sort()
            for n in sorted(names):
                full = os.path.join(root, n)
                rel = os.path.relpath(full, layout)
                data = open(full, "rb").read()
                add_bytes(tar, rel, data, epoch)
    with open(os.path.join(out_dir, "digest"), "w", encoding="utf-8") as f:
        f.write(manifest_desc["digest"] + "\n")
    return reference, manifest_desc["digest"], len(layer_gz)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", default=os.path.join(REPO, "target/release"),
                    help="directory holding gpuledger-operator and gpuledger-device-plugin")
    ap.add_argument("--out-dir", default=os.path.join(REPO, "target/image"))
    ap.add_argument("--revision", default="", help="source revision for the labels (git commit)")
    args = ap.parse_args()
    epoch_raw = os.environ.get("SOURCE_DATE_EPOCH", "0")
    try:
        epoch = int(epoch_raw)
    except ValueError:
        print(f"oci-image: SOURCE_DATE_EPOCH={epoch_raw!r} is not a number of seconds", file=sys.stderr)
        return 2
    try:
        repository, tag = chart_reference(REPO)
        os.makedirs(args.out_dir, exist_ok=True)
        reference, digest, size = build(args.bin_dir, args.out_dir, repository, tag, epoch, args.revision)
    except (ImageError, OSError) as e:
        print(f"oci-image: {e}", file=sys.stderr)
        return 1
    print(f"{reference} {digest} (layer {size / 1048576:.1f} MiB) in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
