"""GPU check step: ``%%distributed -n 1`` on the GPU through nbclient (check.py runs it).

A notebook is executed top to bottom by nbclient in a fresh kernel: ``%load_ext hora``,
``%dist_start -n 1 --backend nccl``, a ``%%distributed`` cell that puts a model on the GPU,
a second cell that trains it one step and checks it is still there (same device, same
storage: the engine kept it between cells), ``%dist_stop``. Prints one JSON line. ``--cpu``
rehearses the same notebook on CPU with gloo (``check.sh --rehearse``).
"""

from __future__ import annotations

import json
import sys

CELLS = [
    "%load_ext hora",
    "%dist_start -n 1 --backend nccl --local --no-preflight",
    "%%distributed\nimport torch\nmodel = torch.nn.Linear(64, 8).cuda()\n"
    "ptr0 = next(model.parameters()).data_ptr()\n"
    "print('cell1', next(model.parameters()).device)",
    "%%distributed\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "model(torch.randn(32, 64, device='cuda')).square().mean().backward()\nopt.step()\n"
    "p = next(model.parameters())\n"
    "print('cell2', p.device, p.data_ptr() == ptr0, torch.cuda.memory_allocated() > 0)",
    "%dist_stop",
]
WANT = {"cell1": "cell1 cuda:0", "cell2": "cell2 cuda:0 True True"}


def _text(cell: dict) -> str:  # type: ignore[type-arg]
    out = []
    for o in cell.get("outputs", []):
        out.append(o.get("text", "") or "".join(o.get("data", {}).get("text/plain", "")))
    return "".join(out)


def main() -> int:
    import nbformat
    from nbclient import NotebookClient

    cells, want = CELLS, WANT
    if "--cpu" in sys.argv:
        swap = {"nccl": "gloo", ".cuda()": "", "device='cuda'": "device='cpu'", "cuda:0": "cpu",
                "torch.cuda.memory_allocated() > 0": "True"}
        for a, b in swap.items():
            cells = [c.replace(a, b) for c in cells]
            want = {k: v.replace(a, b) for k, v in want.items()}
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    NotebookClient(nb, timeout=90, kernel_name="python3").execute()
    texts = [_text(c) for c in nb.cells]
    found = {k: any(w in t for t in texts) for k, w in want.items()}
    ok = all(found.values())
    print(json.dumps({"step": "notebook", "pass": ok, "found": found,
                      "outputs": [t[-300:] for t in texts],
                      "summary": f"model created on {want['cell1'][6:]} in one cell, trained in "
                      "the next on the same storage" if ok else f"missing output: {found}"}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
