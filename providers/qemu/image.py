"""The `qemu` provider's guest image: a Debian kernel and a slim initramfs, built on this machine.

What goes in (nothing is downloaded but the kernel package, and only when asked):

* the kernel: the uncompressed `vmlinux` (PVH entry) extracted from a Debian
  `linux-image-<version>-amd64` package (XZ-compressed bzImage decompression costs ~6 s per
  boot under TCG; the ELF boots directly), and the few virtio/9p modules the guest loads;
* the initramfs (raw newc cpio: a compressed one boots slower under TCG): busybox-static and a
  shell `/init`; the host's own interpreter with its shared-library closure (`ldd`),
  stripped; its standard library as bytecode only (`unchecked-hash`, no sources, no tests,
  no OpenSSL/sqlite/curses/dbm), at the same absolute paths as on the host, so the worker's
  handshake (version, prefix) holds; the worker's packages (`agent_sandbox`'s folders and
  `h11`), with their bytecode; and the guest agent (`qemu/guest.py`).

Everything is cached under `<cache>/qemu/images/<hash>/`, where `<cache>` is
`$XDG_CACHE_HOME/agent-sandbox` (default `~/.cache/agent-sandbox`) and `<hash>` covers every
input (the kernel package's bytes, the interpreter and libraries by path, size and mtime,
the worker's sources by content, this builder's version): a changed input is a new image.

The kernel package is looked for, in order: the path given, `$AGENT_SANDBOX_QEMU_KERNEL_DEB`,
`<cache>/qemu/debs/` and the system store `/var/cache/agent-sandbox/qemu/` (which
`scripts/setup.sh` fills as root). When none is found and `download` is allowed and we are
root, `apt-get download` fetches it into the cache; otherwise the error names the command.

This module is longer than 600 lines because the image is one recipe: what goes into
the guest and what the image's hash is made of must change together (a file baked in but not
hashed would let a stale image serve).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import glob
import hashlib
import importlib.util
import json
import lzma
import os
import py_compile
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

__all__ = [
    "BUILDER_VERSION",
    "GUEST_MODULES",
    "Image",
    "ImageError",
    "build_image",
    "cache_root",
    "find_image",
    "locate_kernel_deb",
    "missing_tools",
    "no_space",
]

#: Bumped whenever the image layout or the guest's /init changes.
BUILDER_VERSION = "1"
#: The guest kernel modules, loaded in this order after their dependencies.
GUEST_MODULES = ("virtio_mmio", "virtio_console", "9pnet_virtio", "9p")
SYSTEM_DEB_STORE = "/var/cache/agent-sandbox/qemu"
_DEB_GLOB = "linux-image-*-amd64_*.deb"
_PRUNE_DIRS = frozenset(
    {
        "test",
        "tests",
        "idlelib",
        "tkinter",
        "turtledemo",
        "ensurepip",
        "lib2to3",
        "site-packages",
        "dist-packages",
        "pydoc_data",
        "__pycache__",
        "venv",
    }
)
_SLIM_DROP = frozenset(
    {
        "_ssl",
        "_hashlib",
        "_sqlite3",
        "_dbm",
        "_gdbm",
        "readline",
        "_curses",
        "_curses_panel",
        "nis",
        "_crypt",
        "_tkinter",
        "_ctypes_test",
        "_testcapi",
        "_testbuffer",
        "_testinternalcapi",
        "_testmultiphase",
        "_testclinic",
        "_testimportmultiple",
        "_xxtestfuzz",
        "xxlimited",
        "xxlimited_35",
        "ossaudiodev",
        "audioop",
    }
)
_APPLETS = ("sh", "mount", "mkdir", "insmod", "cat", "sed", "sleep", "poweroff", "echo")
#: The worker's third-party modules (imported by `agent_sandbox._worker.server`).
_WORKER_DISTS = ("h11", "wrapt")

ProgressFn = Callable[[str], None]

_INIT = """#!/bin/sh
# agent_sandbox qemu guest: PID 1 until it execs the guest agent. Any failed step stops the VM.
export PATH=/bin
fail() { echo "sb-init: $*"; poweroff -f; }
mount -t proc proc /proc || fail "mount /proc"
mount -t sysfs sysfs /sys || fail "mount /sys"
mount -t devtmpfs devtmpfs /dev || fail "mount /dev"
# /tmp stays the image's own folder (no tmpfs over it): the worker's packages are staged at
# their host paths, which may lie under /tmp (a checkout there). The VM's RAM bounds it.
mkdir -p /tmp && chmod 1777 /tmp || fail "/tmp"
mount -t tmpfs -o mode=0755,size=8m tmpfs /run || fail "mount /run"
for m in $(cat /etc/sb-modules); do insmod /lib/modules/$m.ko || fail "insmod $m"; done
exec {python} -S -B /sb/agent.py
"""


class ImageError(Exception):
    """The image cannot be built or found; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Image:
    """A built image: its directory, kernel, initramfs and identity."""

    directory: str
    vmlinux: str
    initrd: str
    digest: str
    python: str
    kernel_release: str

    @classmethod
    def load(cls, directory: str) -> Image:
        with open(os.path.join(directory, "image.json")) as fh:
            meta = json.load(fh)
        return cls(
            directory=directory,
            vmlinux=os.path.join(directory, "vmlinux"),
            initrd=os.path.join(directory, "initrd.cpio"),
            digest=str(meta["digest"]),
            python=str(meta["python"]),
            kernel_release=str(meta["kernel_release"]),
        )


def cache_root() -> str:
    """`$XDG_CACHE_HOME/agent-sandbox` (default `~/.cache/agent-sandbox`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "agent-sandbox")


def missing_tools() -> list[tuple[str, str]]:
    """(tool, Debian package) for each tool the build or the boot needs and lacks."""
    need = [
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("busybox", "busybox-static"),
        ("dpkg-deb", "dpkg"),
        ("ldd", "libc-bin"),
        ("strip", "binutils"),
    ]
    out = []
    for tool, package in need:
        if shutil.which(tool) is None:
            out.append((tool, package))
    if not out and not _busybox_static(shutil.which("busybox") or ""):
        out.append(("busybox (static)", "busybox-static"))
    return out


def _busybox_static(path: str) -> bool:
    try:
        run = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "not a dynamic executable" in (run.stdout + run.stderr)


def no_space(where: str) -> str:
    """The one error for a full disk while building (what to free, and how)."""
    return (
        f"the disk holding {where} is full; free space there (`agent-sandbox qemu clean` "
        "removes old images and templates, or point XDG_CACHE_HOME at a larger disk) and retry"
    )


def install_hint(missing: Iterable[tuple[str, str]]) -> str:
    packages = " ".join(sorted({pkg for _tool, pkg in missing}))
    return f"apt-get install --no-install-recommends {packages} (as root)"


# -- the kernel ------------------------------------------------------------------------


def _deb_dirs() -> list[str]:
    return [os.path.join(cache_root(), "qemu", "debs"), SYSTEM_DEB_STORE]


def locate_kernel_deb(path: str | None = None, *, download: bool = False) -> str:
    """The Debian kernel package to use (see the module docstring for the search order)."""
    if path:
        if not os.path.isfile(path):
            raise ImageError(f"the kernel package {path!r} does not exist")
        return os.path.abspath(path)
    env = os.environ.get("AGENT_SANDBOX_QEMU_KERNEL_DEB")
    if env:
        if not os.path.isfile(env):
            raise ImageError(f"AGENT_SANDBOX_QEMU_KERNEL_DEB={env!r} does not exist")
        return env
    for folder in _deb_dirs():
        found = sorted(glob.glob(os.path.join(folder, _DEB_GLOB)))
        found = [f for f in found if "-cloud-" not in f and "-rt-" not in f]
        if found:
            return found[-1]
    command = "apt-get download linux-image-<version>-amd64 (the one linux-image-amd64 depends on)"
    if download and os.geteuid() == 0 and shutil.which("apt-get"):
        return _download_kernel(_deb_dirs()[0])
    raise ImageError(
        "no Debian kernel package (linux-image-*-amd64_*.deb) found in "
        + " or ".join(_deb_dirs())
        + f"; run `agent-sandbox qemu build` as root (it runs `{command}`), or pass "
        "--kernel-deb PATH"
    )


def _download_kernel(folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    dep = subprocess.run(
        ["apt-cache", "depends", "linux-image-amd64"], capture_output=True, text=True, timeout=60
    )
    match = re.search(r"Depends: (linux-image-\S+-amd64)\b", dep.stdout)
    if match is None:
        raise ImageError(
            "apt-cache does not know linux-image-amd64; run `apt-get update` as root first"
        )
    got = subprocess.run(
        ["apt-get", "download", match.group(1)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
    )
    found = sorted(glob.glob(os.path.join(folder, _DEB_GLOB)))
    if got.returncode != 0 or not found:
        raise ImageError(f"`apt-get download {match.group(1)}` failed: {got.stderr.strip()}")
    return found[-1]


def _extract_vmlinux(bzimage: bytes) -> bytes:
    """The ELF kernel inside a Debian bzImage (XZ payload)."""
    start = bzimage.find(b"\xfd7zXZ\x00")
    if start < 0:
        raise ImageError("the kernel image has no XZ payload (not a Debian generic kernel?)")
    out = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(bzimage[start:])
    if out[:4] != b"\x7fELF":
        raise ImageError("the kernel's XZ payload is not an ELF vmlinux")
    return out


_MODULE_DIRS = (
    "kernel/drivers/virtio/",
    "kernel/drivers/char/virtio_console.ko",
    "kernel/net/9p/",
    "kernel/fs/9p/",
    "kernel/fs/netfs/",
    "kernel/fs/fscache/",
)


def _depends(path: str) -> list[str]:
    """A module's `depends=` field (its `.modinfo`), read from the file's bytes."""
    with open(path, "rb") as fh:
        data = fh.read()
    at = data.find(b"\0depends=")
    if at < 0:
        return []
    value = data[at + len(b"\0depends=") : data.index(b"\0", at + 1)].decode()
    return [d.replace("-", "_") for d in value.split(",") if d]


def _module_order(found: dict[str, str], wanted: Iterable[str]) -> list[tuple[str, str]]:
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        if name not in found:
            raise ImageError(f"the kernel package has no module {name!r}")
        for dep in _depends(found[name]):
            visit(dep)
        order.append(name)

    for name in wanted:
        visit(name)
    return [(name, found[name]) for name in order]


def _kernel_dir(deb_hash: str) -> str:
    return os.path.join(cache_root(), "qemu", "kernels", deb_hash[:20])


def _unpack_kernel(
    deb: str, deb_hash: str, progress: ProgressFn
) -> tuple[str, str, list[tuple[str, str]]]:
    """The vmlinux path, the release and the guest modules (name, path) in load order,
    extracted once per kernel package into `<cache>/qemu/kernels/<hash>/`."""
    directory = _kernel_dir(deb_hash)
    meta_path = os.path.join(directory, "kernel.json")
    if not os.path.isfile(meta_path):
        progress("unpacking the kernel (vmlinux and the virtio/9p modules)")
        parent = os.path.dirname(directory)
        os.makedirs(parent, exist_ok=True)
        work = tempfile.mkdtemp(prefix=".unpack-", dir=parent)
        try:
            fsys = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", deb], stdout=subprocess.PIPE)
            assert fsys.stdout is not None
            with tarfile.open(fileobj=fsys.stdout, mode="r|") as tar:
                for member in tar:
                    name = member.name.lstrip("./")
                    keep = name.startswith("boot/vmlinuz-") or (
                        name.startswith("lib/modules/")
                        and any(f"/{d}" in name for d in _MODULE_DIRS)
                        and name.endswith(".ko")
                    )
                    if keep and member.isfile():
                        src = tar.extractfile(member)
                        assert src is not None
                        out = os.path.join(work, os.path.basename(name))
                        with open(out, "wb") as fh:
                            shutil.copyfileobj(src, fh)
            if fsys.wait() != 0:
                raise ImageError(f"cannot unpack {deb} (dpkg-deb failed)")
            kernels = sorted(glob.glob(os.path.join(work, "vmlinuz-*")))
            if not kernels:
                raise ImageError(f"{deb} holds no /boot/vmlinuz-*")
            release = os.path.basename(kernels[-1])[len("vmlinuz-") :]
            with open(kernels[-1], "rb") as fh:
                vmlinux = _extract_vmlinux(fh.read())
            with open(os.path.join(work, "vmlinux"), "wb") as fh:
                fh.write(vmlinux)
            os.unlink(kernels[-1])
            with open(os.path.join(work, "kernel.json"), "w") as fh:
                json.dump({"release": release, "deb": os.path.basename(deb)}, fh)
            if os.path.isdir(directory):
                shutil.rmtree(directory)
            os.rename(work, directory)
        except (OSError, tarfile.TarError) as exc:
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise ImageError(no_space(parent)) from None
            raise ImageError(f"cannot unpack {deb}: {exc}") from None
        finally:
            shutil.rmtree(work, ignore_errors=True)
    with open(meta_path) as fh:
        release = str(json.load(fh)["release"])
    found = {
        f[: -len(".ko")].replace("-", "_"): os.path.join(directory, f)
        for f in os.listdir(directory)
        if f.endswith(".ko")
    }
    return os.path.join(directory, "vmlinux"), release, _module_order(found, GUEST_MODULES)


# -- the initramfs ---------------------------------------------------------------------


def packages_file() -> str:
    return os.path.join(cache_root(), "qemu", "packages.json")


def configured_packages() -> list[str]:
    """The extra packages baked into the image (`agent-sandbox qemu build --package`)."""
    try:
        with open(packages_file()) as fh:
            names = json.load(fh)
    except (OSError, ValueError):
        return []
    return sorted({str(n) for n in names}) if isinstance(names, list) else []


def _package_trees(names: Iterable[str]) -> dict[str, str]:
    """Each extra package's folder (and its wheel's `<name>.libs` folder of shared libraries)."""
    out: dict[str, str] = {}
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or (spec.origin is None and not spec.submodule_search_locations):
            raise ImageError(f"the package {name!r} is not installed in this environment")
        if spec.submodule_search_locations:
            folder = os.path.realpath(next(iter(spec.submodule_search_locations)))
        else:
            folder = os.path.realpath(str(spec.origin))
        out[name] = folder
        libs = os.path.join(os.path.dirname(folder), name + ".libs")
        if os.path.isdir(libs):
            out[name + ".libs"] = os.path.realpath(libs)
    return out


def _worker_trees() -> dict[str, str]:
    """Folders whose content the worker imports: agent_sandbox's packages, h11 and wrapt."""
    from agent_sandbox._host.launch import package_dirs

    trees = dict(package_dirs())
    for dist in _WORKER_DISTS:
        spec = importlib.util.find_spec(dist)
        if spec is None or not spec.submodule_search_locations:
            raise ImageError(f"the worker needs {dist!r}, which is not installed")
        trees[dist] = os.path.realpath(next(iter(spec.submodule_search_locations)))
    return trees


def _stdlib_files(stdlib: str) -> Iterator[str]:
    for dirpath, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _PRUNE_DIRS and not d.startswith("config-"))
        for name in sorted(files):
            if name.endswith((".pyc", ".a", ".exe")):
                continue
            if name.split(".")[0] in _SLIM_DROP or name.startswith("_codecs_"):
                continue
            yield os.path.join(dirpath, name)


#: The qemu provider's host-side modules: never imported in the guest, so neither baked in
#: nor part of the image's hash (the guest agent is baked as /sb/agent.py).
_HOST_ONLY = frozenset({"provider.py", "relay.py", "image.py", "cli_qemu.py"})


def _tree_files(root: str) -> Iterator[str]:
    if os.path.isfile(root):
        yield root
        return
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "tests"))
        for name in sorted(files):
            if name in _HOST_ONLY:
                continue
            if name.endswith((".py", ".so")) or name == "py.typed":
                yield os.path.join(dirpath, name)


def _ldd(paths: Iterable[str]) -> list[str]:
    libs: set[str] = set()
    for path in paths:
        run = subprocess.run(["ldd", path], capture_output=True, text=True)
        for line in run.stdout.splitlines():
            match = re.search(r"(/\S+) \(0x", line)
            if match:
                libs.add(match.group(1))
    return sorted(libs)


def _python() -> tuple[str, str]:
    """The interpreter workers run (resolved) and its standard library folder."""
    from agent_sandbox._host.launch import worker_python

    exe = os.path.realpath(worker_python())
    return exe, sysconfig.get_paths()["stdlib"]


_DEB_HASHES: dict[str, str] = {}


def _deb_hash(deb: str) -> str:
    """The package's sha256 (remembered per path, size and mtime for this process)."""
    key = _stat_key(deb)
    if key not in _DEB_HASHES:
        h = hashlib.sha256()
        with open(deb, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        _DEB_HASHES[key] = h.hexdigest()
    return _DEB_HASHES[key]


def image_inputs(deb: str) -> dict[str, object]:
    """What the image is made of, as JSON-safe data; its hash names the image."""
    exe, stdlib = _python()
    deb_hash = _deb_hash(deb)
    stats = hashlib.sha256()
    for path in [exe, *_stdlib_files(stdlib)]:
        st = os.stat(path)
        stats.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    content = hashlib.sha256()
    trees = _worker_trees()
    for name in sorted(trees):
        for path in _tree_files(trees[name]):
            content.update(path.encode() + b"\0")
            with open(path, "rb") as fh:
                content.update(fh.read())
    with open(_guest_agent_source(), "rb") as fh:
        content.update(fh.read())
    packages = configured_packages()
    extra = hashlib.sha256()
    for name, tree in sorted(_package_trees(packages).items()):
        for path in _tree_files(tree):
            st = os.stat(path)
            extra.update(f"{name}\0{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    with open(os.path.realpath(__file__), "rb") as fh:
        builder_source = hashlib.sha256(fh.read()).hexdigest()
    return {
        "builder_source": builder_source,
        "packages": packages,
        "packages_files": extra.hexdigest(),
        "builder": BUILDER_VERSION,
        "kernel_deb": deb_hash,
        "python": exe,
        "stdlib": stats.hexdigest(),
        "worker": content.hexdigest(),
        "busybox": _stat_key(shutil.which("busybox") or ""),
        "init": hashlib.sha256(_INIT.encode()).hexdigest(),
    }


def _stat_key(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def _guest_agent_source() -> str:
    return os.path.join(os.path.dirname(os.path.realpath(__file__)), "guest.py")


def _copy(src: str, root: str, dst: str | None = None) -> None:
    """Copy `src` into `root` at `dst` (default: the same path), recreating symlink chains."""
    dst = dst or src
    out = os.path.join(root, dst.lstrip("/"))
    if os.path.lexists(out):
        return
    os.makedirs(os.path.dirname(out), exist_ok=True)
    if os.path.islink(src):
        target = os.readlink(src)
        os.symlink(target, out)
        _copy(
            os.path.normpath(os.path.join(os.path.dirname(src), target)),
            root,
            os.path.normpath(os.path.join(os.path.dirname(dst), target)),
        )
    else:
        shutil.copy2(src, out)


def _stage(root: str, modules: list[tuple[str, str]], progress: ProgressFn) -> str:
    """Fill `root` with the guest's files; return the interpreter path."""
    for folder in ("bin", "dev", "proc", "sys", "tmp", "run", "mnt", "etc", "sb", "lib/modules"):
        os.makedirs(os.path.join(root, folder), exist_ok=True)
    busybox = shutil.which("busybox") or "/bin/busybox"
    shutil.copy2(busybox, os.path.join(root, "bin", "busybox"))
    for applet in _APPLETS:
        os.symlink("busybox", os.path.join(root, "bin", applet))
    for name, path in modules:
        out = os.path.join(root, "lib", "modules", name + ".ko")
        shutil.copy2(path, out)
        subprocess.run(["strip", "--strip-debug", out], capture_output=True)
    with open(os.path.join(root, "etc", "sb-modules"), "w") as fh:
        fh.write("\n".join(name for name, _ in modules) + "\n")
    exe, stdlib = _python()
    with open(os.path.join(root, "init"), "w") as fh:
        fh.write(_INIT.replace("{python}", exe))
    os.chmod(os.path.join(root, "init"), 0o755)
    shutil.copy2(_guest_agent_source(), os.path.join(root, "sb", "agent.py"))
    progress("interpreter and standard library")
    elfs = [exe]
    _copy(exe, root)
    for path in _stdlib_files(stdlib):
        _copy(path, root)
        if path.endswith(".so"):
            elfs.append(path)
    trees = _worker_trees()
    for tree in trees.values():
        for path in _tree_files(tree):
            _copy(path, root)
            if path.endswith(".so"):
                elfs.append(path)
    for lib in _ldd(elfs):
        _copy(lib, root)
        elfs.append(lib)
    for tree in _package_trees(configured_packages()).values():
        for path in _tree_files(tree):
            _copy(path, root)
            if path.endswith(".so") or ".so." in os.path.basename(path):
                elfs.append(path)
            elif path.endswith(".py"):
                staged = os.path.join(root, path.lstrip("/"))
                _compile(path, importlib.util.cache_from_source(staged), hashed=True)
        libs = [e for e in _ldd(elfs) if not os.path.lexists(os.path.join(root, e.lstrip("/")))]
        for lib in libs:
            _copy(lib, root)
            elfs.append(lib)
    with open(os.path.join(root, "sb", "trees.json"), "w") as fh:
        json.dump(trees, fh)
    progress("bytecode")
    _compile_stdlib(stdlib, root)
    for tree in trees.values():
        for path in _tree_files(tree):
            if path.endswith(".py"):
                staged = os.path.join(root, path.lstrip("/"))
                cached = importlib.util.cache_from_source(staged)
                _compile(path, cached, hashed=True)
    progress("stripping")
    # A wheel's libraries stay as shipped: stripping what auditwheel/patchelf rewrote can
    # leave an ELF the loader refuses ("load command address/offset not page-aligned").
    wheel_roots = tuple(t.rstrip("/") + "/" for t in _package_trees(configured_packages()).values())
    for elf in set(elfs):
        if os.path.realpath(elf).startswith(wheel_roots):
            continue
        staged = os.path.join(root, os.path.realpath(elf).lstrip("/"))
        if os.path.isfile(staged) and not os.path.islink(staged):
            os.chmod(staged, os.stat(staged).st_mode | stat.S_IWUSR)
            subprocess.run(["strip", "--strip-unneeded", staged], capture_output=True)
    return exe


def _compile(source: str, target: str, *, hashed: bool) -> None:
    """Compile `source` (its frames keep the host path) into `target`."""
    mode = py_compile.PycInvalidationMode.UNCHECKED_HASH if hashed else None
    try:
        py_compile.compile(source, target, dfile=source, doraise=True, invalidation_mode=mode)
    except py_compile.PyCompileError:
        pass  # a file the interpreter cannot compile is not importable on the host either


def _compile_stdlib(stdlib: str, root: str) -> None:
    """The standard library as sourceless `.pyc` next to where the `.py` was: the host's own
    cached bytecode when it is current (its header matches the source), else compiled."""
    staged_stdlib = os.path.join(root, stdlib.lstrip("/"))
    for dirpath, _dirs, files in os.walk(staged_stdlib):
        for name in files:
            if not name.endswith(".py"):
                continue
            staged = os.path.join(dirpath, name)
            source = "/" + os.path.relpath(staged, root)
            target = staged + "c"
            cached = importlib.util.cache_from_source(source)
            if _pyc_current(source, cached):
                shutil.copyfile(cached, target)
            else:
                _compile(source, target, hashed=True)
            os.unlink(staged)


def _pyc_current(source: str, cached: str) -> bool:
    try:
        with open(cached, "rb") as fh:
            head = fh.read(16)
        st = os.stat(source)
    except OSError:
        return False
    if len(head) < 16 or head[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags = int.from_bytes(head[4:8], "little")
    if flags & 1:  # hash-based: valid for its source by construction of the checked kinds
        return False
    mtime = int.from_bytes(head[8:12], "little")
    size = int.from_bytes(head[12:16], "little")
    return mtime == int(st.st_mtime) & 0xFFFFFFFF and size == st.st_size & 0xFFFFFFFF


def _cpio(root: str, out_path: str) -> int:
    """Write `root` as a newc archive (plus /dev/console); return the entry count."""
    count = 0

    def header(
        name: str, mode: int, size: int, mtime: int, rdev: tuple[int, int] = (0, 0)
    ) -> bytes:
        nonlocal count
        count += 1
        raw = name.encode() + b"\0"
        fields = (count, mode, 0, 0, 1, mtime, size, 0, 0, rdev[0], rdev[1], len(raw), 0)
        head = b"070701" + "".join(f"{v:08X}" for v in fields).encode() + raw
        return head + b"\0" * (-len(head) % 4)

    with open(out_path, "wb") as out:
        out.write(header("dev", stat.S_IFDIR | 0o755, 0, 0))
        out.write(header("dev/console", stat.S_IFCHR | 0o600, 0, 0, (5, 1)))
        for dirpath, dirs, files in os.walk(root):
            dirs.sort()
            for name in [*dirs, *sorted(files)]:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                if rel == "dev":
                    continue
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    data = os.readlink(path).encode()
                elif stat.S_ISREG(st.st_mode):
                    with open(path, "rb") as fh:
                        data = fh.read()
                else:
                    data = b""
                out.write(header(rel, st.st_mode, len(data), int(st.st_mtime)))
                out.write(data + b"\0" * (-len(data) % 4))
        out.write(header("TRAILER!!!", 0, 0, 0))
        pad = -out.tell() % 512
        out.write(b"\0" * pad)
    return count


# -- build and find --------------------------------------------------------------------


def images_dir() -> str:
    return os.path.join(cache_root(), "qemu", "images")


def _digest(inputs: Mapping[str, object]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]


_DIGESTS: dict[tuple[str, str], str] = {}


def find_image(kernel_deb: str | None = None) -> Image | None:
    """The cached image for the current inputs, or None (nothing is built). The inputs are
    read once per process and kernel package (a worker start does not rehash them)."""
    try:
        deb = locate_kernel_deb(kernel_deb)
    except ImageError:
        return None
    key = (cache_root(), _stat_key(deb))
    if key not in _DIGESTS:
        _DIGESTS[key] = _digest(image_inputs(deb))
    directory = os.path.join(images_dir(), _DIGESTS[key])
    if os.path.isfile(os.path.join(directory, "image.json")):
        return Image.load(directory)
    return None


def build_image(
    kernel_deb: str | None = None,
    *,
    download: bool = False,
    force: bool = False,
    packages: Sequence[str] | None = None,
    progress: ProgressFn | None = None,
) -> Image:
    """Build (or find) the image for the current inputs; see the module docstring."""
    say = progress or (lambda _msg: None)
    if packages is not None:
        _package_trees(packages)  # each one must exist before anything is recorded
    missing = missing_tools()
    if missing:
        tools = ", ".join(tool for tool, _pkg in missing)
        raise ImageError(f"missing {tools}: {install_hint(missing)}")
    deb = locate_kernel_deb(kernel_deb, download=download)
    say(f"kernel package {os.path.basename(deb)}")
    if packages is not None:
        os.makedirs(os.path.dirname(packages_file()), exist_ok=True)
        with open(packages_file(), "w") as fh:
            json.dump(sorted(set(packages)), fh)
        _DIGESTS.clear()
    inputs = image_inputs(deb)
    digest = _digest(inputs)
    directory = os.path.join(images_dir(), digest)
    os.makedirs(images_dir(), exist_ok=True)
    lock_fd = os.open(os.path.join(images_dir(), ".lock"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(directory, "image.json")) and not force:
            say(f"image {digest} is up to date")
            return Image.load(directory)
        t0 = time.monotonic()
        work = tempfile.mkdtemp(prefix=".build-", dir=images_dir())
        try:
            vmlinux, release, modules = _unpack_kernel(deb, str(inputs["kernel_deb"]), say)
            root = os.path.join(work, "root")
            say("staging the initramfs")
            exe = _stage(root, modules, say)
            out = os.path.join(work, "out")
            os.mkdir(out)
            shutil.copy2(vmlinux, os.path.join(out, "vmlinux"))
            say("writing the cpio archive")
            entries = _cpio(root, os.path.join(out, "initrd.cpio"))
            meta = {
                "digest": digest,
                "inputs": inputs,
                "python": exe,
                "kernel_release": release,
                "entries": entries,
                "initrd_bytes": os.path.getsize(os.path.join(out, "initrd.cpio")),
                "build_seconds": round(time.monotonic() - t0, 2),
            }
            with open(os.path.join(out, "image.json"), "w") as fh:
                json.dump(meta, fh, indent=1)
            if os.path.isdir(directory):
                shutil.rmtree(directory)
            os.rename(out, directory)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise ImageError(no_space(images_dir())) from None
            raise ImageError(f"building the image failed: {exc}") from None
        finally:
            shutil.rmtree(work, ignore_errors=True)
        say(f"image {digest} built in {time.monotonic() - t0:.1f} s")
        return Image.load(directory)
    finally:
        os.close(lock_fd)


if __name__ == "__main__":  # pragma: no cover - a manual entry point
    print(build_image(sys.argv[1] if len(sys.argv) > 1 else None, progress=print))
