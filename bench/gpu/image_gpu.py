"""GPU check step: the GPU image runs ``torch.cuda.is_available()`` (check.py runs it).

``hora image build --gpu`` (or ``--image TAG``: an image built before), then
``docker run --rm --gpus all IMAGE -c "import torch; ..."`` must print True with the GPU's
name. Needs a Docker engine with the NVIDIA container runtime. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

PROBE = ("import json, torch; print(json.dumps({'available': torch.cuda.is_available(), "
         "'torch': torch.__version__, 'cuda': torch.version.cuda, 'name': "
         "torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", help="an image built before (default: build hora:gpu now)")
    args = p.parse_args()
    tag = args.image or "hora:gpu"
    if not args.image:
        hora = shutil.which("hora") or "hora"
        build = subprocess.run([hora, "image", "build", "--gpu"], capture_output=True, text=True)
        sys.stdout.write(build.stdout[-2000:] + build.stderr[-2000:])
        if build.returncode:
            print(json.dumps({"step": "gpu_image", "pass": False,
                              "summary": f"hora image build --gpu exited {build.returncode}"}))
            return 1
    run = subprocess.run(["docker", "run", "--rm", "--gpus", "all", tag, "-c", PROBE],
                         capture_output=True, text=True, timeout=300)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    found = json.loads(lines[-1]) if lines else {}
    ok = run.returncode == 0 and found.get("available") is True
    print(json.dumps({"step": "gpu_image", "pass": ok, "image": tag, "found": found,
                      "summary": f"{tag}: torch {found.get('torch')} cuda {found.get('cuda')} "
                      f"is_available {found.get('available')} ({found.get('name')})" if found
                      else f"docker run exited {run.returncode}: {run.stderr[-300:]}"}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
