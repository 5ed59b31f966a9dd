"""python -m tests.e2e_vllm [run|record|install|fit-profile|check-profile|fit-and-check] — see
docs/testing.md, "Real vLLM (make e2e-vllm)", and docs/simulator.md, "Fitting a profile".

run            the whole e2e (default); figures printed at the end, exit 1 on a failed check
record         re-record tests/fixtures/vllm-<version>/ from real vLLM (one command per version)
install        only the cached vLLM virtualenv and the tiny model
prefix         only the prefill-policy check (step 8 of run: prefix-affinity against the flat interleave)
fit-profile    measure real vLLM on CPU and write the simulator's cpu-tiny-llama profile
check-profile  the same load on real vLLM and on `pdserve sim --profile cpu-tiny-llama`: within 25 %
fit-and-check  fit a profile to this machine's real vLLM (a file of the run), then check-profile with it
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tests.e2e_vllm.common import Failed, fail_exit, say


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.e2e_vllm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "command",
        nargs="?",
        default="run",
        choices=("run", "record", "install", "prefix", "fit-profile", "check-profile", "fit-and-check"),
    )
    parser.add_argument("--out", type=Path, default=None, help="keep logs and recordings here")
    args = parser.parse_args(argv)
    try:
        if args.command == "install":
            from tests.e2e_vllm.model import ensure_model
            from tests.e2e_vllm.venv import ensure_venv

            ensure_venv()
            ensure_model()
            return 0
        if args.command in ("fit-profile", "check-profile", "fit-and-check"):
            import tempfile

            from tests.e2e_vllm.fit import check_profile, fit_and_check, fit_profile

            work = args.out or Path(tempfile.mkdtemp(prefix="pdserve-e2e-profile-"))
            work.mkdir(parents=True, exist_ok=True)
            command = {
                "fit-profile": fit_profile,
                "check-profile": check_profile,
                "fit-and-check": fit_and_check,
            }
            result = command[args.command](work)
            say("done")
            print(json.dumps(result, indent=1), flush=True)
            return 0
        if args.command == "prefix":
            import tempfile

            from tests.e2e_vllm.model import ensure_model
            from tests.e2e_vllm.prefix import prefix_policies
            from tests.e2e_vllm.venv import ensure_venv

            ensure_venv()
            ensure_model()
            work = args.out or Path(tempfile.mkdtemp(prefix="pdserve-e2e-prefix-"))
            work.mkdir(parents=True, exist_ok=True)
            print(json.dumps(prefix_policies(work), indent=1), flush=True)
            say("passed")
            return 0
        from tests.e2e_vllm.run import run

        figures = run(out=args.out, record_only=args.command == "record", keep=args.out is not None)
    except (Failed, AssertionError) as exc:
        return fail_exit(exc)
    say("passed" if args.command == "run" else "recorded")
    print(json.dumps(figures, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
