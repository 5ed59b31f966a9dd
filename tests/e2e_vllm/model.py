"""The tiny random-weight Llama, built once into the cache's HF_HOME as a repo the hub cache knows.

Why the hub cache and not a directory: the example manifest names ``spec.model:
pdserve-test/tiny-llama`` and works as written (``HF_HUB_OFFLINE=1`` with this ``HF_HOME``
resolves it without a download), the same way a real model id would. The snapshot's revision
is the hash of make_model.py, so a change to the builder builds a new snapshot.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

from tests.e2e_vllm.common import HERE, MODEL_ID, check, hf_home, python_of_venv, say

REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def snapshot_dir() -> Path:
    revision = hashlib.sha1((HERE / "make_model.py").read_bytes()).hexdigest()
    org, name = MODEL_ID.split("/")
    return hf_home() / "hub" / f"models--{org}--{name}" / "snapshots" / revision


def ensure_model() -> Path:
    """The snapshot directory of the tiny model, built if missing."""
    snapshot = snapshot_dir()
    repo = snapshot.parents[1]
    if all((snapshot / f).exists() for f in REQUIRED):
        say(f"tiny model {MODEL_ID} cached in {hf_home()}")
    else:
        say(f"building the tiny model {MODEL_ID} (random weights, offline tokenizer) into {hf_home()}")
        building = snapshot.with_name(snapshot.name + ".building")
        shutil.rmtree(building, ignore_errors=True)
        out = subprocess.run(
            [python_of_venv(), str(HERE / "make_model.py"), str(building)], capture_output=True, text=True
        )
        check(out.returncode == 0, f"make_model.py failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        shutil.rmtree(snapshot, ignore_errors=True)
        building.rename(snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(snapshot.name)
    size = sum(f.stat().st_size for f in snapshot.iterdir())
    say(f"tiny model: {size / 1e6:.1f} MB at {snapshot}")
    return snapshot
