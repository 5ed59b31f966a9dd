"""Container entry of the pod runner: bind-mount the volumes, then exec the container's command.

Runs as ``unshare --mount --propagation private python container_entry.py SPEC.json``, so the
mounts exist only in this container's mount namespace and vanish with its last process. The
exec keeps the PID (and the process group the runner created), so the runner signals the
container's own process. Nothing here imports beyond the standard library: it is on the start
path of every container.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _mount(source: str, target: str, read_only: bool) -> None:
    src, dst = Path(source), Path(target)
    if src.is_dir():
        dst.mkdir(parents=True, exist_ok=True)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            dst.touch()
    subprocess.run(["mount", "--bind", str(src), str(dst)], check=True)
    if read_only:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(dst)], check=True)


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        for m in sorted(spec["mounts"], key=lambda m: len(m["target"])):
            _mount(m["source"], m["target"], m["readOnly"])
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"pod-runner: mounting the volumes failed: {exc}", file=sys.stderr, flush=True)
        return 126
    cwd = spec.get("cwd")
    if cwd:
        Path(cwd).mkdir(parents=True, exist_ok=True)
        os.chdir(cwd)
    argv = spec["argv"]
    try:
        os.execvpe(argv[0], argv, spec["env"])
    except OSError as exc:
        print(f"pod-runner: cannot run {argv[0]!r}: {exc}", file=sys.stderr, flush=True)
        return 127


if __name__ == "__main__":
    sys.exit(main())
