"""The vLLM release pdserve is built and checked against, and its images.

Rendering (flags, each connector's ``kv_transfer_config``, the admission rules), the
simulator's wire formats and errors, and the recordings in tests/fixtures/vllm-<VERSION>/ are
read from this release. The examples, the docs' default images and the CRD's messages name its
images, and `pdserve up --engine vllm` requires at least it. tests/unit/test_vllm_version.py
fails when any of them names another release: change it here and there together.
"""

from __future__ import annotations

VERSION = "0.32.0"
#: ``VERSION`` as numbers, for comparisons.
RELEASE: tuple[int, int, int] = (0, 32, 0)
#: ``major.minor``: the series whose patch releases share flags and wire formats.
SERIES = "0.32"

#: vLLM's official images of this release (Docker Hub; the CPU build on its public ECR).
IMAGE = f"vllm/vllm-openai:v{VERSION}"
ROCM_IMAGE = f"vllm/vllm-openai-rocm:v{VERSION}"
CPU_IMAGE = f"public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v{VERSION}"
